"""Session fixtures for the eagle-serve tests: the tiny export (tests/tiny_export.py)
copied with a chat template, a reference `EagleRuntime` over it, and one server on a loopback
port (uvicorn in a thread) whose runtime drafts with `OracleDrafter`: registered prompts get
their reference continuation proposed K tokens deep (so each round commits K + 1 tokens and
chunk boundaries are known), any other prompt gets the export's own EAGLE head."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from eagle_deploy.contract.verify import rerecord_files
from eagle_deploy.runtime.grammar import GrammarError
from eagle_deploy.runtime.tree import DraftTree
from tests.conftest import HEAD_TREE
from tests.tiny_export import copy_export, tiny_export

THREADS = 1

ORACLE_DEPTH = 3  # draft tokens per oracle round: a full round commits 4 tokens
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ORACLE_PROMPTS = ["def add(a, b):", "Hello there, how are you?", "for i in range(10): print(i)", "The quick brown fox",
                  "import numpy as np", "Once upon a time", "SELECT * FROM users", "x = [1, 2, 3]"]
REF_TOKENS = 64


class OracleDrafter:
    """Registered prompt ids -> one path of the next ORACLE_DEPTH reference tokens per round;
    other requests are drafted by `inner` (an EagleDrafter), decided at the request's first
    round."""

    def __init__(self, inner, depth: int = ORACLE_DEPTH):
        self.inner, self.depth = inner, depth
        self.refs: dict[tuple, list[int]] = {}
        self._use = None

    @property
    def forwards(self) -> int:
        return self.inner.forwards

    def reset(self) -> None:
        self._use = None
        self.inner.reset()

    def propose(self, request):
        committed = [int(t) for t in request.committed]
        if self._use is None:
            hits = [(p, r) for p, r in self.refs.items() if tuple(committed[:len(p)]) == p]
            self._use = max(hits, key=lambda h: len(h[0])) if hits else False
        if not self._use:
            return self.inner.propose(request)
        prompt, ref = self._use
        pos = len(committed) - len(prompt)
        path = ref[pos:pos + self.depth] if committed[len(prompt):] == ref[:pos] else []
        path = path[: min(request.max_depth, request.max_nodes - 1)]
        return DraftTree.from_paths(committed[-1], [path]) if path else DraftTree.root_only(committed[-1])


class Faults:
    """The server's round hook: users "fail-*" raise at their first round; users "slow-*"
    sleep 5 ms per round; users "hold-*" wait in every round until `release` is set (or the
    job is cancelled; 60 s at most), so a test decides when their slot frees; users "later-*"
    wait so in every round after their first text delta was emitted; users "grammar-*" raise
    a GrammarError (the grammar engine gave up) at their first round, users "lategrammar-*" in
    their first round after a text delta; per-job rounds and rounds seen after cancellation
    are recorded."""

    def __init__(self):
        self.rounds = defaultdict(int)
        self.after_cancel = defaultdict(int)
        self.users = {}
        self.slots = {}  # job -> the engine slot that decoded it
        self.release = threading.Event()
        self.held = threading.Semaphore(0)  # released once per hold-* round that starts waiting

    def __call__(self, job) -> None:
        user = job.work.user or ""
        self.rounds[job.seq] += 1
        self.users[job.seq] = user
        self.slots[job.seq] = job.slot
        if job.cancelled:
            self.after_cancel[job.seq] += 1
        if user.startswith("fail-"):
            raise RuntimeError("injected fault")
        if user.startswith("grammar-") or (user.startswith("lategrammar-") and job.t_first is not None):
            raise GrammarError("injected: the grammar engine gave up")
        if user.startswith("slow-"):
            time.sleep(0.005)
        if user.startswith("hold-") or (user.startswith("later-") and job.t_first is not None):
            self.held.release()
            deadline = time.monotonic() + 60
            while not (self.release.wait(0.01) or job.cancelled or time.monotonic() > deadline):
                pass


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread; with `cli_flags`,
    the uvicorn.Server eagle-serve builds (serve.cli.build_server: its protocol, timeouts,
    request limit and drain) for those eagle-serve flags, else uvicorn's defaults."""

    def __init__(self, app, cli_flags: list[str] | None = None):
        import uvicorn

        from eagle_deploy.serve.cli import build_parser, build_server

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        if cli_flags is None:
            self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        else:
            args = build_parser().parse_args(["--engines", "-", "--log-level", "warning", *cli_flags])
            self.server = build_server(args, app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.app = app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


@pytest.fixture(scope="session")
def serve_export(tmp_path_factory) -> Path:
    """A copy of the tiny export whose tokenizer has a (toy) chat template."""
    from transformers import AutoTokenizer

    folder = copy_export(tiny_export(tmp_path_factory), tmp_path_factory.mktemp("serve") / "tiny")
    tok_dir = folder / "tokenizer"
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(tok_dir))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["chat_template"] = True
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    rerecord_files(folder)  # the tokenizer changed on purpose: the manifest lists its files (contract/verify.py)
    return folder


@pytest.fixture(scope="session")
def reference(serve_export):
    """A separate EagleRuntime over the export (the export's own head): what the server must match."""
    from eagle_deploy.runtime.api import EagleRuntime

    return EagleRuntime.load(serve_export, threads=THREADS, **HEAD_TREE)


@pytest.fixture(scope="session")
def oracle_refs(reference) -> dict[str, list[int]]:
    """Oracle prompt -> its reference greedy continuation (vanilla decoding, up to EOS)."""
    return {p: reference.generate(p, REF_TOKENS, chat=False, mode="vanilla").token_ids for p in ORACLE_PROMPTS}


@pytest.fixture(scope="session")
def long_prompt(oracle_refs) -> str:
    """A registered prompt whose reference runs 50 tokens or more before EOS: a request on it
    runs verification rounds (and a test's round hook sees them) whatever its max_tokens."""
    return next(p for p in ORACLE_PROMPTS if len(oracle_refs[p]) >= 50)


@pytest.fixture
def faults(server) -> Faults:
    """The round hook of the server under test (each server has its own: job numbers restart)."""
    return server.faults


def make_server(folder: Path, faults=None, oracle_refs=None, reference=None, slots: int = 1, app_kw=None,
                cli_flags: list[str] | None = None, **runtime_kw):
    """A started ServerThread over `folder` (SlotScheduler with `slots` slots + create_app with
    `app_kw`; cli_flags: see ServerThread); with `oracle_refs`, every slot drafts with an
    OracleDrafter around its EAGLE drafter."""
    from eagle_deploy.contract.manifest import Manifest
    from eagle_deploy.runtime.backends import load_backend
    from eagle_deploy.runtime.drafter import EagleDrafter
    from eagle_deploy.serve.app import create_app
    from eagle_deploy.serve.scheduler import SlotScheduler

    kw = {**HEAD_TREE, "threads": THREADS, **runtime_kw}
    if oracle_refs is not None:
        def oracle(inner):
            drafter = OracleDrafter(inner)
            for prompt, ref in oracle_refs.items():
                drafter.refs[tuple(reference.encode(prompt, chat=False))] = ref
            return drafter

        if slots == 1:
            m = Manifest.load(folder)
            kw["drafter"] = oracle(EagleDrafter(load_backend("ort", folder, m, "draft", THREADS, tree=m.tree), m.tree,
                                                m.max_length, m.draft.graph_top_k))
        else:
            kw["drafters"] = lambda slot, inner: oracle(inner)
    scheduler = SlotScheduler.load(folder, slots=slots, max_queue=32, round_hook=faults, **kw)
    srv = ServerThread(create_app(scheduler, poll_s=0.02, **(app_kw or {})), cli_flags).start()
    srv.faults = faults
    return srv


SERVER_SLOTS = [1, 4]


@pytest.fixture(scope="session", params=SERVER_SLOTS, ids=[f"slots{n}" for n in SERVER_SLOTS])
def server(request, serve_export, oracle_refs, reference):
    """The server, once with one slot (requests one at a time) and once with 4 batched slots
    whose prompts of 10 tokens or more are prefilled in chunks of 8 while other slots decode:
    every server test runs against both."""
    chunk = {"prefill_chunk": 8} if request.param > 1 else {}
    srv = make_server(serve_export, Faults(), oracle_refs, reference, slots=request.param, **chunk)
    yield srv
    srv.stop()
