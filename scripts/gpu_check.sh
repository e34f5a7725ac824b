#!/usr/bin/env bash
# GPU acceptance check for the TensorRT and onnxruntime-CUDA paths: one run, one JSON report.
#
#   pip uninstall -y onnxruntime && pip install '.[gpu]' '.[test]'   # on a CUDA host
#   bash scripts/gpu_check.sh                      # report: gpu_check/report.json
#
# Steps (each recorded with exit code, seconds, stdout as JSON when it is JSON, stderr tail;
# a failing step does not stop the others):
#   env        GPU, driver, TensorRT / onnxruntime / torch versions, ORT providers
#   export     eagle-export --model smollm2-135m --dtype fp16 --backend trt  (ONNX + engines)
#   pytest     the gpu-marked tests (tests/exporter/test_trt_build.py, tests/runtime/test_trt_backend.py: real builds,
#              same tokens as ORT-CPU, fp16 with large activations, out-of-profile shapes), if tests/ is here
#   validate   eagle-validate --engines DIR
#   bench      eagle-bench --engines DIR --backends ort-cuda,trt --json
#   run-<b>    eagle-run --backend <b> --compare-vanilla --json   (vanilla vs EAGLE, b = ort-cuda, trt)
#
# Settings (environment): OUT (gpu_check), MODEL (smollm2-135m), DTYPE (fp16),
# MAX_NEW_TOKENS (128), SKIP_EXPORT=1 with ENGINES=DIR to reuse an export.
set -uo pipefail

OUT=${OUT:-gpu_check}
MODEL=${MODEL:-smollm2-135m}
DTYPE=${DTYPE:-fp16}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}
PROMPT=${PROMPT:-"Write a Python function that checks whether a number is prime, then explain it."}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python}

mkdir -p "$OUT/steps"
OUT=$(cd "$OUT" && pwd)
: > "$OUT/steps.tsv"

step() {  # step NAME CMD...: run, record "name<TAB>rc<TAB>seconds<TAB>command"
    local name=$1; shift
    local t0 t1 rc
    echo "== $name: $*" >&2
    t0=$(date +%s%N)
    "$@" > "$OUT/steps/$name.out" 2> "$OUT/steps/$name.err"
    rc=$?
    t1=$(date +%s%N)
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(awk "BEGIN {print ($t1 - $t0) / 1e9}")" "$*" >> "$OUT/steps.tsv"
    echo "   rc=$rc" >&2
    return $rc
}

step env "$PY" - <<'EOF'
import json, subprocess
info = {}
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=30).stdout.strip()
except Exception as err:  # noqa: BLE001
    info["nvidia_smi"] = f"unavailable: {err}"
for mod in ("torch", "tensorrt", "onnxruntime", "polygraphy", "onnx"):
    try:
        info[mod] = __import__(mod).__version__
    except Exception as err:  # noqa: BLE001
        info[mod] = f"missing: {err}"
try:
    import torch
    info["cuda_available"] = torch.cuda.is_available()
    info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    import onnxruntime
    info["ort_providers"] = onnxruntime.get_available_providers()
except Exception as err:  # noqa: BLE001
    info["error"] = str(err)
print(json.dumps(info))
EOF

if [[ "${SKIP_EXPORT:-0}" == 1 ]]; then
    ENGINES=${ENGINES:?set ENGINES=DIR with SKIP_EXPORT=1}
else
    step export eagle-export --model "$MODEL" --dtype "$DTYPE" --backend trt --out "$OUT/engines" --force
    ENGINES=$(tail -n 1 "$OUT/steps/export.out" 2>/dev/null)
fi
echo "engines: $ENGINES" >&2

if [[ -d "$ROOT/tests" ]]; then
    (cd "$ROOT" && step pytest "$PY" -m pytest -m gpu -rA -q -p no:cacheprovider tests/exporter/test_trt_build.py tests/runtime/test_trt_backend.py)
fi

if [[ -d "$ENGINES" ]]; then
    step validate eagle-validate --engines "$ENGINES"
    step bench eagle-bench --engines "$ENGINES" --backends ort-cuda,trt --json
    for b in ort-cuda trt; do
        step "run-$b" eagle-run --engines "$ENGINES" --backend "$b" --prompt "$PROMPT" \
            --max-new-tokens "$MAX_NEW_TOKENS" --compare-vanilla --json
    done
else
    echo "no export folder ($ENGINES); skipping validate/bench/run" >&2
fi

"$PY" - "$OUT" "$ENGINES" <<'EOF'
import json, sys, time
from pathlib import Path

out, engines = Path(sys.argv[1]), sys.argv[2]

def parse(text):
    text = text.strip()
    for candidate in (text, text.splitlines()[-1] if text else ""):
        try:
            return json.loads(candidate)
        except ValueError:
            pass
    return None

steps = {}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, secs, cmd = line.split("\t", 3)
    stdout = (out / "steps" / f"{name}.out").read_text(errors="replace")
    stderr = (out / "steps" / f"{name}.err").read_text(errors="replace")
    steps[name] = {"command": cmd, "rc": int(rc), "seconds": round(float(secs), 1), "json": parse(stdout),
                   "stdout_tail": stdout[-4000:], "stderr_tail": stderr[-4000:]}
manifest = Path(engines) / "manifest.json" if engines else None
report = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "engines": engines,
          "passed": all(s["rc"] == 0 for s in steps.values()),
          "trt_engines": json.loads(manifest.read_text()).get("engines", {}).get("trt") if manifest and manifest.exists() else None,
          "steps": steps}
(out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
print(out / "report.json")
print(json.dumps({k: v["rc"] for k, v in steps.items()}), file=sys.stderr)
EOF
