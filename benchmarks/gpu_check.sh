#!/usr/bin/env bash
# The GPU check: every CUDA figure of kvswap from one run on a bare CUDA machine.
#
#   bash benchmarks/gpu_check.sh            # from the repository root; <= 8 minutes on one H200
#
# Steps, each bounded with `timeout`; one that fails or times out is recorded as failed
# and the next one runs:
#   tests     pytest -m gpu over the test files that hold CUDA tests      (90 s)
#   bench     kvswap bench --full --device cuda --json                    (60 s)
#   transfer  benchmarks/transfer.py --device cuda                        (60 s)
#   engine    benchmarks/engine.py --device cuda --json (full size)       (250 s)
# Writes ONE JSON file, gpu_check.json (the environment, each step's status and
# every figure), plus one log per step, under $OUT (else benchmarks/results/).
#
# Nothing here assumes a GPU ever ran this code, nor that the machine has the
# project installed: it uses $PYTHON (default python3) as it is, with src/ first on
# PYTHONPATH so the checkout's code runs. kvswap needs pydantic, and the test
# fixtures import redis; a CUDA image without them can be given wheels in .whl/
# (or $KVSWAP_WHEELS), installed into a temporary directory first. Made elsewhere with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl pydantic==2.14.4 \
#     pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     typing-extensions==4.16.0 redis==8.1.0
set -u
cd "$(dirname "$0")/.." || exit 1

PY=${PYTHON:-python3}
OUT_DIR=${OUT:-benchmarks/results}
WHEELS=${KVSWAP_WHEELS:-.whl}
mkdir -p "$OUT_DIR" || exit 1
WORK=$(mktemp -d) || exit 1
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
: >"$WORK/steps.tsv"

{
    echo "python: $(command -v "$PY") $("$PY" --version 2>&1)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    if ! "$PY" -c "import pydantic, redis" 2>/dev/null && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$WORK/site" "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:$WORK/site"
    fi
    "$PY" -c "import kvswap, torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} >"$OUT_DIR/setup.log" 2>&1  # a group, not a subshell: its export holds below

# run_step NAME SECONDS STDOUT_FILE COMMAND...: stdout to STDOUT_FILE ("-": the log),
# stderr to $OUT_DIR/NAME.log; records NAME, exit status and seconds.
run_step() {
    local name=$1 limit=$2 stdout=$3 start rc
    shift 3
    [ "$stdout" = "-" ] && stdout="$OUT_DIR/$name.log"
    echo "== $name: $*" >&2
    start=$(date +%s)
    if [ "$stdout" = "$OUT_DIR/$name.log" ]; then
        timeout --kill-after=15 "$limit" "$@" >"$stdout" 2>&1
    else
        timeout --kill-after=15 "$limit" "$@" >"$stdout" 2>"$OUT_DIR/$name.log"
    fi
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" "$limit" >>"$WORK/steps.tsv"
}

# The root conftest imports redis (the remote-tier fixtures, no CUDA test uses them):
# without redis, load only the unit fixtures.
mapfile -t GPU_TESTS < <(grep -rl "pytest.mark.gpu" tests --include='test_*.py' | sort)
PYTEST_FLAGS=(-q -p no:cacheprovider -m gpu --junitxml="$WORK/tests.xml")
"$PY" -c "import redis" 2>/dev/null || PYTEST_FLAGS+=(--noconftest -p tests.unit.conftest)
run_step tests 90 - "$PY" -m pytest "${PYTEST_FLAGS[@]}" "${GPU_TESTS[@]}"
run_step bench 60 "$WORK/bench.json" "$PY" -m kvswap bench --full --device cuda --json
run_step transfer 60 - "$PY" benchmarks/transfer.py --device cuda
run_step engine 250 "$WORK/engine_stdout.json" \
    "$PY" benchmarks/engine.py --device cuda --json --out "$WORK/engine.json"

# One JSON file from the pieces (stdlib only; any piece may be missing or broken).
"$PY" - "$WORK" "$OUT_DIR" <<'EOF'
import json, sys, time, xml.etree.ElementTree as ET
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])

def read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return {"unreadable": f"{path.name}: {error}"}

def last_json_line(path):
    try:
        lines = [l for l in path.read_text().splitlines() if l.startswith("{")]
        return json.loads(lines[-1]) if lines else {"unreadable": f"no JSON line in {path.name}"}
    except (OSError, ValueError) as error:
        return {"unreadable": f"{path.name}: {error}"}

def junit(path):
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as error:
        return {"unreadable": f"{path.name}: {error}"}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["not_passed"] = [
        f"{case.get('classname')}::{case.get('name')}: {child.tag}"
        for case in suite.iter("testcase")
        for child in case
        if child.tag in ("failure", "error", "skipped")
    ]
    return counts

report = {"check": "gpu_check", "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": {}}
try:
    report["setup"] = (out / "setup.log").read_text().splitlines()
except OSError:
    report["setup"] = []
for line in (work / "steps.tsv").read_text().splitlines():
    name, rc, seconds, limit = line.split("\t")
    rc = int(rc)
    status = "ok" if rc == 0 else "timed out" if rc in (124, 137) else "failed"
    report["steps"][name] = {"status": status, "exit_status": rc, "seconds": int(seconds),
                             "limit_s": int(limit), "log": f"{name}.log"}
    if status != "ok":  # why, without opening the log
        try:
            report["steps"][name]["log_tail"] = (out / f"{name}.log").read_text().splitlines()[-8:]
        except OSError:
            pass
figures = {
    "tests": lambda: junit(work / "tests.xml"),
    "bench": lambda: read_json(work / "bench.json"),
    "transfer": lambda: last_json_line(out / "transfer.log"),
    # --out is rewritten after every section: a run stopped part-way keeps those.
    "engine": lambda: read_json(work / "engine.json"),
}
for name, read in figures.items():
    if name in report["steps"]:
        report["steps"][name]["figures"] = read()
report["failed_steps"] = [n for n, s in report["steps"].items() if s["status"] != "ok"]
(out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
print(f"gpu_check: {out / 'gpu_check.json'}; failed steps: {report['failed_steps'] or 'none'}")
EOF
