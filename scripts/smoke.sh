#!/usr/bin/env bash
# Smoke test of an installed localllm: help, `run` and `serve` on a tiny random model (NumPy backend, so no
# kernel compile). .ci/run runs it in a second environment holding the LOWEST versions pyproject allows
# (uv's --resolution lowest-direct), so every declared range is one that works.
#   scripts/smoke.sh [PYTHON]   (default: python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python}
TMP=$(mktemp -d)
export LOCALLLM_HOME=$TMP/home  # a throwaway home: serve's disk tier writes KV blocks there
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$TMP"' EXIT
SERVER=
$PY -c "import sys; sys.path.insert(0, 'tests/support'); from pathlib import Path; \
from tiny_model import write_tiny_model; write_tiny_model(Path('$TMP/tiny.gguf'))"
for cmd in "" run chat serve bench info; do
  $PY -m localllm $cmd --help >/dev/null || { echo "smoke: localllm $cmd --help failed" >&2; exit 1; }
done
$PY -m localllm run "$TMP/tiny.gguf" "hello" -n 4 --backend numpy --temperature 0 >"$TMP/run.out" 2>"$TMP/run.err" \
  || { cat "$TMP/run.err" >&2; echo "smoke: run failed" >&2; exit 1; }
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$PY -m localllm serve "$TMP/tiny.gguf" --backend numpy --port "$PORT" --log-level warning 2>"$TMP/serve.err" &
SERVER=$!
$PY - "$PORT" <<'PYEOF'
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(600):
    try:
        if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
            break
    except OSError:
        time.sleep(0.2)
else:
    sys.exit("smoke: the server never became healthy")
body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(req, timeout=120))
assert reply["choices"][0]["message"]["role"] == "assistant" and reply["usage"]["completion_tokens"] >= 1, reply
print("smoke: help, run and serve work")
PYEOF
