"""`serve` sits on the runtime side: it imports `runtime` and `contract`, never `exporter`
(nor `train`, which imports the exporter)."""
from __future__ import annotations

from tests.test_layout import PACKAGE, imported_modules, sources


def test_serve_never_imports_the_exporter():
    found = [f"{path.relative_to(PACKAGE)} imports {name}" for path in sources("serve")
             for name in imported_modules(path) if name.startswith(("eagle_deploy.exporter", "eagle_deploy.train"))]
    assert sources("serve") and not found, found


def test_the_http_side_reads_only_what_the_scheduler_protocol_declares():
    """Every `scheduler.<member>` the app, the completion flow and the metrics read is declared
    by `engine.Scheduler`, and `SlotScheduler` has every declared member."""
    import ast

    from eagle_deploy.serve.scheduler import RoundGate, Scheduler, Slot, SlotScheduler

    def is_scheduler(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "scheduler") or (
            isinstance(node, ast.Attribute) and node.attr == "scheduler")

    read = {node.attr for name in ("app.py", "completion.py", "metrics.py")
            for node in ast.walk(ast.parse((PACKAGE / "serve" / name).read_text()))
            if isinstance(node, ast.Attribute) and is_scheduler(node.value)}
    declared = set(Scheduler.__annotations__) | {n for n in vars(Scheduler) if not n.startswith("_")}
    assert {"submit", "runtime", "acceptance"} <= read and read <= declared, read - declared
    implemented = set(dir(SlotScheduler)) | set(vars(SlotScheduler([Slot(None, RoundGate())])))
    assert declared <= implemented, declared - implemented
