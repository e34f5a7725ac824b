"""`serve` sits on the runtime side: it imports `runtime` and `contract`, never `exporter`
(nor `train`, which imports the exporter)."""
from __future__ import annotations

from tests.test_layout import PACKAGE, imported_modules, sources


def test_serve_never_imports_the_exporter():
    found = [f"{path.relative_to(PACKAGE)} imports {name}" for path in sources("serve")
             for name in imported_modules(path) if name.startswith(("eagle_deploy.exporter", "eagle_deploy.train"))]
    assert sources("serve") and not found, found
