"""The load client (`python -m eagle_deploy.bench.load`) against the test server: the shape
of its table and JSON (one cell per mode x concurrency), never its timings."""
from __future__ import annotations

import json
import socket

import pytest

from eagle_deploy.bench import load
from tests.tiny_export import PROMPTS, prompt_file

CELL_KEYS = {"mode", "concurrency", "requests", "ok", "dropped", "lost", "errors", "completion_tokens", "wall_s",
             "tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "latency_ms_p50", "tau",
             "same_as_first", "same_as_vanilla", "cached_tokens"}


def test_run_load_cells(server, tmp_path):
    cfg = load.LoadConfig(server.url, prompts=load.load_prompts([str(prompt_file(tmp_path))]), concurrency=[1, 2],
                          modes=["eagle", "vanilla"], max_tokens=8, endpoint="completions", timeout=60)
    result = load.run_load(cfg)
    assert result["schema"] == load.SCHEMA and result["model"] == "tiny"
    assert [(c["mode"], c["concurrency"]) for c in result["cells"]] == [("eagle", 1), ("eagle", 2), ("vanilla", 1),
                                                                       ("vanilla", 2)]
    for cell in result["cells"]:
        assert set(cell) == CELL_KEYS
        assert cell["requests"] == cell["ok"] == len(PROMPTS) and cell["errors"] == []
        assert 0 < cell["completion_tokens"] <= 8 * len(PROMPTS) and cell["tokens_per_s"] > 0
        assert cell["ttft_ms_p50"] <= cell["ttft_ms_p99"] and cell["tau"] >= 1.0
        assert cell["cached_tokens"] == 0  # the test server keeps no prefix cache
    assert all(c["tau"] == 1.0 for c in result["cells"] if c["mode"] == "vanilla")
    n = len(PROMPTS)
    assert [c["same_as_first"] for c in result["cells"]] == [None, [n, n], None, [n, n]]
    # eagle ran first: its cells are compared with vanilla's first cell once vanilla has run
    assert [c["same_as_vanilla"] for c in result["cells"]] == [[n, n], [n, n], None, [n, n]]
    assert load.format_table(result).splitlines()[1].split()[-2] == f"{n}/{n}"  # the final table's =van
    samples = result["samples"]["eagle/2"]
    assert len(samples) == len(PROMPTS) and all(s["ok"] and s["completion_tokens"] >= 1 for s in samples)
    # greedy: the same text at every concurrency and in both modes
    texts = {key: [s["text"] for s in rows] for key, rows in result["samples"].items()}
    assert len({tuple(t) for t in texts.values()}) == 1


def test_cli_table_and_json(server, tmp_path, capsys):
    out = tmp_path / "load.json"
    rc = load.main(["--url", server.url + "/v1", "--sets", "chat", "--limit", "2", "--concurrency", "2",
                    "--modes", "eagle", "--max-tokens", "6", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["mode", "conc", "ok"] and table[1].split()[:3] == ["eagle", "2", "2"]
    result = json.loads(out.read_text())
    assert result["config"]["prompt_ids"] == ["writing-01", "writing-02"] and len(result["cells"]) == 1


def test_eagle_bench_serve_is_the_load_client(server, capsys):
    from eagle_deploy.bench.cli import main as bench_main

    rc = bench_main(["serve", "--url", server.url, "--sets", "chat", "--limit", "1", "--concurrency", "1",
                     "--modes", "vanilla", "--max-new-tokens", "4"])  # eagle-run's and eagle-bench's name
    assert rc == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:3] == ["vanilla", "1", "1"] and 1 <= int(row[3]) <= 4  # completion tokens, capped at 4
    with pytest.raises(SystemExit):
        bench_main(["serve", "--help"])
    assert "usage: eagle-bench serve" in capsys.readouterr().out


def test_cli_errors(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    assert load.main(["--url", f"http://127.0.0.1:{port}", "--sets", "chat", "--limit", "1"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert load.main(["--url", "http://127.0.0.1:1", "--modes", "turbo"]) == 2
    assert "--modes takes eagle and/or vanilla (comma-separated), got 'turbo'" in capsys.readouterr().err
    for flags, message in ((["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
                           (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),  # the flag typed
                           (["--max-new-tokens=-2"], "--max-new-tokens must be >= 1, got -2"),
                           (["--repeat", "0"], "--repeat must be >= 1, got 0"),
                           (["--rate", "-1"], "--rate must be >= 0, got -1.0"),
                           (["--disconnect", "2"], "--disconnect is a share of the requests, in [0, 1], got 2.0")):
        assert load.main(["--url", "http://127.0.0.1:1", *flags]) == 2, flags
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [f"load: error: {message}"], (flags, err)  # one line, before any request
    # a URL without its scheme: one line before any request, prefixed with the command typed
    from eagle_deploy.bench.cli import main as bench_main

    assert bench_main(["serve", "--url", "notaurl"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == ("eagle-bench serve: error: --url takes the server's address with its scheme, "
                                         "e.g. http://127.0.0.1:8000, got 'notaurl'")
    assert load.main(["--url", "http://127.0.0.1:1", "--sets", "nonexistent"]) == 2


def test_200_requests_with_random_disconnects(server, tmp_path):
    """200 greedy streaming requests, 8 in flight, about 30% abandoned by the client after their
    first chunk: none is lost, every completed one has exactly its prompt's solo text, and the
    server ends idle with every slot free and its KV as allocated."""
    from tests.serve.test_server import scheduler, wait_idle

    base = load.load_prompts([str(prompt_file(tmp_path))])
    kw = dict(modes=["eagle"], max_tokens=24, endpoint="completions", timeout=60, warmup=False)
    solo = load.run_load(load.LoadConfig(server.url, prompts=base, concurrency=[1], **kw))
    want = {s["prompt_id"]: s["text"] for s in solo["samples"]["eagle/1"]}
    prompts = load.repeated(base, 200 // len(base) + 1)[:200]
    sched = scheduler(server)
    kv = sched.batch.kv_bytes if sched.batch else None
    result = load.run_load(load.LoadConfig(server.url, prompts=prompts, concurrency=[8], disconnect=0.3, seed=7, **kw))
    cell = result["cells"][0]
    assert cell["requests"] == 200 and cell["lost"] == 0 and cell["errors"] == []
    assert 40 <= cell["dropped"] <= 80 and cell["ok"] == 200 - cell["dropped"]
    for s in result["samples"]["eagle/8"]:
        if s["ok"]:
            assert s["text"] == want[s["prompt_id"].split("#")[0]]
    health = wait_idle(server)
    assert (health["queued"], health["active"]) == (0, 0)
    assert (sched.batch.kv_bytes if sched.batch else None) == kv


def test_long_prompts_arrive_during_every_cell_and_are_reported_apart(server, tmp_path):
    """--long-prompts: one more client sends long documents back to back while each cell runs;
    the cell's own figures stay over its prompts, the long ones get their own entry, and the
    short requests' greedy text does not change because long prompts are being prefilled."""
    base = load.load_prompts([str(prompt_file(tmp_path))])
    longs = [{"id": f"long-{i}", "set": "long", "prompt": "x" * 40 + p["prompt"] * 6} for i, p in enumerate(base)]
    kw = dict(modes=["eagle"], max_tokens=8, endpoint="completions", timeout=60)
    alone = load.run_load(load.LoadConfig(server.url, prompts=base, concurrency=[2], **kw))
    result = load.run_load(load.LoadConfig(server.url, prompts=base, concurrency=[2], long_prompts=longs,
                                           long_clients=1, **kw))
    cell = result["cells"][0]
    assert set(cell) == CELL_KEYS | {"long"} and cell["requests"] == cell["ok"] == len(base)
    assert cell["long"]["requests"] >= 1 and cell["long"]["ok"] == cell["long"]["requests"]
    assert result["config"]["long_prompt_ids"] == [p["id"] for p in longs]
    assert [s["text"] for s in result["samples"]["eagle/2"]] == [s["text"] for s in alone["samples"]["eagle/2"]]
    assert "long prompts during eagle/2" in load.format_table(result)


def test_open_loop_rate_sends_on_a_schedule(server, tmp_path):
    """--rate: prompt i leaves at i / rate s whatever the replies (so the cell lasts at least
    (n - 1) / rate), and the texts are the closed-loop ones."""
    base = load.load_prompts([str(prompt_file(tmp_path))])
    kw = dict(modes=["eagle"], max_tokens=8, endpoint="completions", timeout=60, warmup=False)
    closed = load.run_load(load.LoadConfig(server.url, prompts=base, concurrency=[2], **kw))
    result = load.run_load(load.LoadConfig(server.url, prompts=base, concurrency=[4], rate=10.0, **kw))
    cell = result["cells"][0]
    assert cell["ok"] == len(base) and cell["wall_s"] >= (len(base) - 1) / 10.0
    assert result["config"]["rate"] == 10.0
    assert [s["text"] for s in result["samples"]["eagle/4"]] == [s["text"] for s in closed["samples"]["eagle/2"]]
