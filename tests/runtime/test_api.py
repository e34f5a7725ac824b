"""The Python API (`EagleRuntime`): prompts as text, chat messages or token ids; results;
streaming; many requests on one loaded instance equal fresh instances; bad input fails with
a clear ValueError (API) or exit code 2 and one line (eagle-run) before any forward."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from eagle_deploy.runtime import api, cli
from eagle_deploy.runtime.api import EagleRuntime, GenerationResult
from tests.conftest import MAX_LENGTH, PROMPTS, THREADS
from tests.helpers import RecordingBackend, export_with_template

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
STATS_KEYS = {"prompt_tokens", "new_tokens", "finish_reason", "target_forwards", "draft_forwards", "mean_accept_len",
              "tokens_per_s", "ttft_ms", "time_ms", "accepted_per_round", "mode", "drafter", "acceptance", "lossless"}


@pytest.fixture(scope="module")
def chat_export(mha, tmp_path_factory):
    """The MHA export with a chat template added to its tokenizer and manifest."""
    return export_with_template(mha.export_dir, tmp_path_factory.mktemp("chat") / "mha-chat", TEMPLATE)


def test_prompt_forms_text_chat_and_ids(mha, chat_export):
    rt = mha.runtime(chat_export)
    tok = rt.tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café? €5 🙂"}]
    rendered = "<|system|>Be brief.\n<|user|>Café? €5 🙂\n<|assistant|>"
    ids = tok.encode(rendered, add_special_tokens=False)
    assert rt.encode(msgs) == ids == list(rendered.encode())
    by_ids = rt.generate(ids, max_new_tokens=20)
    assert rt.generate(msgs, max_new_tokens=20).token_ids == by_ids.token_ids
    assert by_ids.token_ids == mha.expected(ids, 20)
    # a string is one user message when the export has a chat template, unless chat=False
    user = "Hi there"
    assert rt.encode(user) == list(f"<|user|>{user}\n<|assistant|>".encode())
    assert rt.encode(user, chat=False) == list(user.encode())
    assert rt.generate(user, max_new_tokens=12).token_ids == mha.expected(rt.encode(user), 12)
    assert rt.generate(user, max_new_tokens=12, chat=False).token_ids == mha.expected(list(user.encode()), 12)
    # numpy ids are ids too
    assert rt.generate(np.array(ids, dtype=np.int64).tolist(), max_new_tokens=4).token_ids == by_ids.token_ids[:4]
    assert rt.encode(list(np.array(ids[:5]))) == ids[:5]


def test_generation_result_fields(mha):
    rt = mha.rt
    r = rt.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, top_p=0.95, top_k=50, seed=3)
    assert isinstance(r, GenerationResult)
    assert isinstance(r.text, str) and all(isinstance(t, int) for t in r.token_ids)
    assert r.finish_reason in ("stop", "length")
    assert len(r.token_ids) == r.stats.new_tokens and r.stats.prompt_tokens == len(PROMPTS[0])
    assert STATS_KEYS <= set(r.stats.to_json()) and r.stats.lossless is True and r.stats.acceptance == "lossless"
    assert r.stats.target_forwards == 1 + len(r.stats.accepted_per_round)
    assert r.stats.mean_accept_len == pytest.approx(np.mean(r.stats.accepted_per_round), abs=1e-4)
    json.dumps(r.stats.to_json())  # plain JSON types
    # stream() gives the same text as deltas and fills `result`
    request = rt.stream(PROMPTS[0], max_new_tokens=24, temperature=0.8, top_p=0.95, top_k=50, seed=3)
    deltas = list(request)
    res = request.result
    assert ("".join(deltas) == res.text == r.text and res.token_ids == r.token_ids
            and res.finish_reason == r.finish_reason)


REQUESTS = [
    (PROMPTS[0], dict(max_new_tokens=30)),
    (PROMPTS[1], dict(max_new_tokens=30, temperature=0.9, seed=3)),
    (PROMPTS[2], dict(max_new_tokens=25, temperature=0.7, top_p=0.9, top_k=20, seed=11)),
    (PROMPTS[0], dict(max_new_tokens=20, mode="vanilla")),
    (PROMPTS[2], dict(max_new_tokens=40, stop="\x7fnever")),
    (PROMPTS[1], dict(max_new_tokens=30, temperature=0.9, seed=3)),
    (PROMPTS[0], dict(max_new_tokens=30)),
]


def _signature(r: GenerationResult):
    keep = ("new_tokens", "finish_reason", "target_forwards", "draft_forwards", "accepted_per_round",
            "tree_depth_per_round")
    return r.text, r.token_ids, r.finish_reason, {k: r.stats.to_json()[k] for k in keep}


def test_many_requests_on_one_instance_equal_fresh_instances(model):
    rt = model.runtime()
    shared = [_signature(rt.generate(p, **kw)) for p, kw in REQUESTS]
    fresh = [_signature(model.runtime().generate(p, **kw)) for p, kw in REQUESTS]
    assert shared == fresh
    assert shared[1] == shared[5] and shared[0] == shared[6]
    assert shared[1][1] != model.expected(PROMPTS[1], 30)  # the sampled request really sampled
    assert shared[0][1] == model.expected(PROMPTS[0], 30)


def test_interleaved_streams_on_one_instance_fail_loudly(mha):
    """Two paused streams cannot share one instance's KV: the older one raises instead of
    decoding from overwritten KV; the newer one is correct."""
    rt = mha.runtime()
    a = rt.stream(PROMPTS[0], max_new_tokens=30)
    next(a)
    assert rt.generate(PROMPTS[1], max_new_tokens=30).token_ids == mha.expected(PROMPTS[1], 30)
    with pytest.raises(RuntimeError, match="interleaved"):
        list(a)
    assert rt.generate(PROMPTS[0], max_new_tokens=30).token_ids == mha.expected(PROMPTS[0], 30)


# ---------------------------------------------------------------- bad input: clear errors, no forward

LONG = list(range(1, 250)) * 2  # > max_length tokens
BAD = {
    "temperature<0": (dict(temperature=-0.1), "temperature"),
    "temperature-nan": (dict(temperature=float("nan")), "temperature"),
    "temperature-inf": (dict(temperature=float("inf")), "temperature"),
    "top_p=0": (dict(temperature=1.0, top_p=0.0), "top_p"),
    "top_p>1": (dict(temperature=1.0, top_p=1.5), "top_p"),
    "top_p<0": (dict(top_p=-0.5), "top_p"),
    "top_k<0": (dict(top_k=-1), "top_k"),
    "top_k-float": (dict(top_k=2.5), "top_k"),
    "seed<0": (dict(temperature=1.0, seed=-1), "seed"),
    "max_new_tokens=0": (dict(max_new_tokens=0), "max_new_tokens"),
    "max_new_tokens<0": (dict(max_new_tokens=-4), "max_new_tokens"),
    "max_new_tokens-float": (dict(max_new_tokens=2.5), "max_new_tokens"),
    "max_new_tokens-huge-float": (dict(max_new_tokens=float("inf")), "max_new_tokens"),
    "max_new_tokens-str": (dict(max_new_tokens="8"), "max_new_tokens"),
    "top_k-str": (dict(temperature=0.5, top_k="3"), "top_k"),
    "top_k-bool": (dict(temperature=0.5, top_k=True), "top_k"),
    "seed-float": (dict(temperature=0.5, seed=1.5), "seed"),
    "temperature-str": (dict(temperature="0.5"), "temperature"),
    "stop-empty": (dict(stop=[""]), "stop"),
    "stop-one-empty": (dict(stop=["ok", ""]), "stop"),
    "stop-empty-str": (dict(stop=""), "stop"),  # a plain string is one stop string
    "stop-none-entry": (dict(stop=["ok", None]), "stop"),
    "mode": (dict(mode="fast"), "mode"),
    "empty-text": (dict(prompt=""), "empty"),
    "empty-ids": (dict(prompt=[]), "empty"),
    "too-long-ids": (dict(prompt=LONG), "prompt tokens fit .*: shorten the prompt"),
    "max-length-ids": (dict(prompt=[5] * MAX_LENGTH), "prompt tokens fit .*: shorten the prompt"),
    "too-long-text": (dict(prompt="x" * (MAX_LENGTH + 5)), "prompt tokens fit .*: shorten the prompt"),
    "id-out-of-vocab": (dict(prompt=[5, 256]), r"\[0, 256\)"),
    # a command-line argument that is not UTF-8 reaches Python as lone surrogates (surrogateescape)
    "not-utf8-text": (dict(prompt="hi \udcff there"), r"^prompt is not valid UTF-8: the byte 0xff at character 3"),
    "lone-surrogate": (dict(prompt="x\ud800"), r"^prompt is not valid Unicode: a lone surrogate \\ud800 at"),
    "not-utf8-message": (dict(prompt=[{"role": "user", "content": "a\udcfe"}]), r"^prompt\[0\].content is not valid"),
    "not-utf8-stop": (dict(stop=["ok", "\udce9t\udce9"]), r"^stop\[1\] is not valid UTF-8: the byte 0xe9 at"),
    "message-without-content": (dict(prompt=[{"role": "user"}]), r"^prompt\[0\].content is missing"),
    "message-content-not-text": (dict(prompt=[{"role": "user", "content": 3}]), r"^prompt\[0\].content must be a"),
    "too-many-stops": (dict(stop=[f"s{i}" for i in range(17)]), "^stop holds at most 16 stop strings, got 17"),
    "stop-too-long": (dict(stop=["ok", "x" * 257]), r"^stop\[1\] has 257 characters"),
}


def _recording(rt: EagleRuntime):
    rt.decoder.target = RecordingBackend(rt.decoder.target)
    rt.decoder.drafter.backend = RecordingBackend(rt.decoder.drafter.backend)
    return lambda: len(rt.decoder.target.calls) + len(rt.decoder.drafter.backend.calls)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_before_any_forward(mha, case):
    rt = mha.runtime()
    forwards = _recording(rt)
    kw, match = BAD[case]
    kw = {"prompt": PROMPTS[0], "max_new_tokens": 8, **kw}
    with pytest.raises(ValueError, match=match):
        rt.generate(**kw)
    with pytest.raises(ValueError, match=match):
        rt.stream(**kw)  # at the call, not at the first next()
    assert forwards() == 0
    # the instance is unharmed
    assert rt.generate(PROMPTS[0], max_new_tokens=8).token_ids == mha.expected(PROMPTS[0], 8)
    assert forwards() > 0


def test_bad_threshold_fails_at_load(mha):
    for t in (0.0, -0.2, 1.5):
        with pytest.raises(ValueError, match="threshold"):
            mha.runtime(acceptance="threshold", threshold=t)
    with pytest.raises(ValueError, match="acceptance"):
        mha.runtime(acceptance="typical")


def test_longest_prompt_that_fits_still_runs(mha):
    r = mha.rt.generate([5] * (MAX_LENGTH - 1), max_new_tokens=8)
    assert len(r.token_ids) == 2 and r.finish_reason == "length"  # KV holds 256 rows; the last token needs none


CLI_BAD = {
    "temperature<0": ["--temperature", "-1"],
    "top-p=0": ["--top-p", "0"],
    "top-p>1": ["--top-p", "1.01"],
    "top-k<0": ["--top-k", "-2"],
    "max-new-tokens=0": ["--max-new-tokens", "0"],
    "seed<0": ["--temperature", "1", "--seed", "-3"],
    "empty-stop": ["--stop", "ok", "--stop", ""],
    "empty-prompt": ["--prompt", ""],
    "too-long-prompt": ["--prompt", "y" * (MAX_LENGTH + 1)],
    "threshold=0": ["--acceptance", "threshold", "--threshold", "0"],
    "threshold>1": ["--acceptance", "threshold", "--threshold", "1.5"],
    "stream+json": ["--stream", "--json"],
    "total-tokens=1": ["--total-tokens", "1"],
    "depth=0": ["--depth", "0"],
    "threads=0": ["--threads", "0"],
}


@pytest.mark.parametrize("case", list(CLI_BAD))
def test_cli_bad_input_exit_2_one_line_no_forward(mha, case, capsys, monkeypatch):
    made = []
    real = api.load_backend

    def counting(*a, **kw):
        made.append(RecordingBackend(real(*a, **kw)))
        return made[-1]

    monkeypatch.setattr(api, "load_backend", counting)
    args = ["--engines", str(mha.export_dir), "--prompt", "hello", "--raw", "--threads", str(THREADS)] + CLI_BAD[case]
    assert cli.main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eagle-run: error: "), err
    assert "Traceback" not in err
    assert sum(len(b.calls) for b in made) == 0
    if case != "too-long-prompt":
        assert made == []  # settings that need no model fail before the graphs are loaded


def test_cli_bad_input_in_a_real_process(mha):
    proc = subprocess.run([sys.executable, "-m", "eagle_deploy.runtime.cli", "--engines", str(mha.export_dir),
                           "--prompt", "hi", "--top-p", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["eagle-run: error: --top-p must be in (0, 1], got 2.0"]


def test_cli_seed_is_reproducible_and_matches_the_api(mha, capsys):
    args = ["--engines", str(mha.export_dir), "--prompt", "Seeds: é€🙂", "--raw", "--max-new-tokens", "20",
            "--threads", str(THREADS), "--temperature", "0.9", "--top-p", "0.95", "--top-k", "40", "--json"]
    runs = []
    for seed in ("5", "5", "6"):
        assert cli.main(args + ["--seed", seed]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["token_ids"] == runs[1]["token_ids"] != runs[2]["token_ids"]
    # the CLI's default drafter (hybrid, planned: plans from the device costs cached on first use, so every
    # process on this machine plans alike) through the API
    rt = mha.runtime(drafter_kind="hybrid", planned=True)
    api_run = rt.generate("Seeds: é€🙂", max_new_tokens=20, temperature=0.9, top_p=0.95, top_k=40, seed=5,
                          chat=False)
    assert api_run.token_ids == runs[0]["token_ids"] and api_run.text == runs[0]["text"]
    assert runs[0]["stats"]["lossless"] is True


def test_cli_summary_names_the_drafter_and_the_rounds_it_drafted(mha, capsys):
    base = ["--engines", str(mha.export_dir), "--prompt", "ab ab ab ab", "--raw", "--max-new-tokens", "12",
            "--threads", str(THREADS)]
    for drafter in ("hybrid", "lookup", "eagle"):
        assert cli.main(base + ["--drafter", drafter, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        stats = out["stats"]
        # the lookup drafter never opens the draft graph, so there is no memory stage for it
        assert ("rss_draft_loaded_mb" in out["memory"]) == (drafter != "lookup"), out["memory"]
        assert cli.main(base + ["--drafter", drafter]) == 0
        summary = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[eagle")]
        rounds = len(stats["accepted_per_round"])
        assert summary and summary[0].startswith(
            f"[eagle: {drafter} drafter, {stats['draft_rounds']} of {rounds} rounds drafted] "), summary
    assert cli.main(base + ["--vanilla"]) == 0
    assert any(line.startswith("[vanilla] ") for line in capsys.readouterr().err.splitlines())


def test_whole_number_settings_given_as_floats_or_huge_ints_run(mha):
    """top_k=3.0, seed=1.0 and max_new_tokens=10**30 are whole numbers: they run like 3, 1
    and a request bounded by the KV capacity (no TypeError after the prefill)."""
    rt = mha.runtime()
    a = rt.generate(PROMPTS[0], max_new_tokens=6, temperature=0.8, top_k=3.0, seed=1.0)
    b = rt.generate(PROMPTS[0], max_new_tokens=6, temperature=0.8, top_k=3, seed=1)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6
    r = rt.generate(PROMPTS[0], max_new_tokens=10**30)
    assert r.finish_reason in ("stop", "length") and 0 < len(r.token_ids) <= MAX_LENGTH


def _truncate(path):
    path.write_bytes(path.read_bytes()[: 1 << 12])


DAMAGED = {
    "truncated target graph": (lambda d: _truncate(d / "target.onnx"), "target.onnx"),
    "truncated draft graph": (lambda d: _truncate(d / "draft.onnx"), "draft.onnx"),
    "tokenizer removed": (lambda d: __import__("shutil").rmtree(d / "tokenizer"), "tokenizer"),
    "manifest is a list": (lambda d: (d / "manifest.json").write_text("[]"), "manifest.json"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_export_folder_is_one_clear_error(mha, tmp_path, capsys, case):
    import shutil

    folder = tmp_path / "export"
    shutil.copytree(mha.export_dir, folder)
    damage, word = DAMAGED[case]
    damage(folder)
    rc = cli.main(["--engines", str(folder), "--prompt", "hello", "--raw", "--threads", str(THREADS)])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("eagle-run: error: ") and word in lines[0], err


def test_cli_vanilla_with_compare_vanilla_is_a_usage_error(capsys):
    """`--vanilla --compare-vanilla` used to run vanilla alone and drop the comparison silently."""
    with pytest.raises(SystemExit) as exit:
        cli.main(["--engines", "x", "--prompt", "hi", "--vanilla", "--compare-vanilla"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "--compare-vanilla: not allowed with argument --vanilla" in err


@pytest.mark.parametrize("flags, message", [
    (["--vanilla", "--drafter", "lookup"], "--drafter has no effect: --vanilla decodes without a draft"),
    (["--vanilla", "--always-draft", "--depth", "2"],
     "--depth, --always-draft have no effect: --vanilla decodes without a draft"),
    (["--drafter", "lookup", "--tree-top-k", "3"], "--tree-top-k has no effect: --drafter lookup drafts no head tree"),
    (["--drafter", "lookup", "--tree", "dynamic", "--total-tokens", "8"],
     "--tree, --total-tokens have no effect: --drafter lookup drafts no head tree"),
    (["--top-k", "5"], "--top-k has no effect: --temperature 0 decodes greedily (the target's most likely token)"),
    (["--threshold", "0.5"], "--threshold has no effect without --acceptance threshold (lossless acceptance takes "
                             "no threshold)"),
    (["--top-p", "0.5", "--top-k", "5", "--temperature", "0"],
     "--top-p, --top-k have no effect: --temperature 0 decodes greedily (the target's most likely token)"),
])
def test_cli_flags_that_change_nothing_are_one_clear_error(capsys, flags, message):
    """Flags the chosen decoding ignores used to be accepted silently (a fresh-user report):
    one line before the export is read (the folder here does not exist)."""
    rc = cli.main(["--engines", "no-such-folder", "--prompt", "hi", *flags])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.strip() == f"eagle-run: error: {message}"


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "-5"], "--max-new-tokens must be an integer >= 1, got -5"),
    (["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
    (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    (["--top-k", "-1"], "--top-k must be an integer >= 0, got -1"),
    (["--seed", "-3"], "--seed must be an integer >= 0, got -3"),
    (["--stop", ""], "--stop must be non-empty strings, got ['']"),
])
def test_cli_request_settings_out_of_range_name_the_flag(capsys, flags, message):
    """The request checks are the API's (check_request, shared with eagle-serve's JSON fields);
    on the command line the message names the flag typed, not the field (a fresh-user report:
    `--max-new-tokens -5` said "max_new_tokens must be ...")."""
    rc = cli.main(["--engines", "no-such-folder", "--prompt", "hi", *flags])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.strip() == f"eagle-run: error: {message}"


def test_cli_drafter_default_is_hybrid_and_explicit_choices_pass_the_check():
    from eagle_deploy.contract.tree_config import DEFAULT_DRAFTER

    parser = cli.build_parser()
    args = parser.parse_args(["--engines", "x", "--prompt", "hi"])
    assert args.drafter is None and DEFAULT_DRAFTER == "hybrid" and "(default: hybrid)" in parser.format_help()
    for flags in (["--drafter", "lookup"], ["--drafter", "eagle", "--depth", "2"], ["--vanilla"]):
        cli._check_no_effect(parser.parse_args(["--engines", "x", "--prompt", "hi", *flags]))


def test_special_token_text_in_a_message_is_plain_text_unless_parse_special(mha, chat_export):
    """A breaker's report: chat content holding a special token's text became that token (a
    message could open a turn of another role). Now it is plain text by default; parse_special
    keeps the old behaviour; messages without such text encode exactly as before."""
    from eagle_deploy.runtime.request import Request

    rt = mha.runtime(chat_export)
    eos_text = rt.tokenizer.convert_ids_to_tokens(0)  # the byte tokenizer's one special token (id 0)
    messages = [{"role": "user", "content": f"hi{eos_text}there"}]
    safe = rt.encode(Request(messages))
    parsed = rt.encode(Request(messages, parse_special=True))
    assert 0 in parsed and 0 not in safe and len(safe) > len(parsed)
    assert rt.tokenizer.decode(safe).count(eos_text) == 1  # the text itself is kept, as text
    plain = [{"role": "user", "content": "hi there"}]
    assert rt.encode(Request(plain)) == rt.encode(Request(plain, parse_special=True))
