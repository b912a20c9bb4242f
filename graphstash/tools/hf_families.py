"""The transformers MoE families whose experts use the experts interface, built tiny.

Used by ``python -m graphstash.tools.hf_matrix`` (the compatibility matrix) and its test. A
family is a ``transformers.models.<family>`` package whose modeling module decorates a class
with ``@use_experts_implementation``; its tiny model is its own default config (the text
config of a multimodal family) with the sizes cut down by the generic rules of
:func:`shrink`, built with random weights in float32.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil

import torch

__all__ = ["VOCAB", "families", "model_class", "shrink", "tiny_model"]

VOCAB = 128
_SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, moe_hidden_size=64, num_attention_heads=4)
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_experts_per_token")
_FLAGS_ON = ("enable_moe_block",)
_ZERO = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
_ONE = ("decoder_sparse_step", "moe_layer_interval", "n_group", "topk_group")
# Fields some default configs leave None although their model needs them (a checkpoint's
# config sets them): given these values when None.
_WHEN_NONE = dict(moe_intermediate_size=32, n_shared_experts=1)
# Default configs that leave a field the model needs unset, per family (the values are small
# and otherwise arbitrary).
_OVERRIDES = {
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                      indexer_budget=8, indexer_compress_ratio=2),
}


def families() -> list[str]:
    """Names of the ``transformers.models`` packages whose modeling module uses the experts
    interface (``@use_experts_implementation``), sorted."""
    import transformers

    found = []
    for info in pkgutil.iter_modules(transformers.models.__path__):
        try:
            spec = importlib.util.find_spec(
                f"transformers.models.{info.name}.modeling_{info.name}")
        except (ImportError, ValueError):
            continue
        if spec is None or spec.origin is None:
            continue
        with open(spec.origin, encoding="utf-8") as f:
            if "@use_experts_implementation" in f.read():
                found.append(info.name)
    return sorted(found)


def model_class(family: str):
    """The causal LM (else the text model) class of ``family`` whose config is a text config."""
    from transformers import PreTrainedModel

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    classes = [c for c in vars(module).values() if inspect.isclass(c)
               and c.__module__ == module.__name__ and issubclass(c, PreTrainedModel)]
    for suffix in ("TextForCausalLM", "ForCausalLM", "TextModel", "Model"):
        for c in classes:
            name = c.__name__
            if (not name.endswith(suffix) or "PreTrained" in name
                    or any(w in name for w in ("Vision", "Audio", "Code2Wav", "Talker"))):
                continue
            config_class = getattr(c, "config_class", None)
            if config_class is None or "text_config" in (getattr(config_class, "sub_configs",
                                                                 None) or {}):
                continue
            return c
    raise LookupError(f"family: no text model class found in transformers.models.{family}")


def _per_layer_lists(config, layers: int) -> dict:
    return {k: v for k, v in vars(config).items()
            if isinstance(v, list) and len(v) == layers and k != "architectures"}


def _keep_layers(lists: dict, layers: int) -> list[int]:
    """Indices of the layers to keep: the first layer of every value of every per-layer list
    (an attention layer and a linear one, a dense MLP and a sparse one), at least two."""
    keep = set()
    for values in lists.values():
        seen = set()
        for i, v in enumerate(values):
            key = repr(v)
            if key not in seen:
                seen.add(key)
                keep.add(i)
    i = 0
    while len(keep) < min(2, layers):
        keep.add(i)
        i += 1
    return sorted(keep)


def _get(config, key):
    try:
        return getattr(config, key, None)
    except Exception:        # noqa: BLE001 - a per-layer attribute some configs refuse to read
        return None


def _set_int(config, key: str, value: int) -> None:
    """Set ``config.key`` where it holds an int (read and written as the config allows)."""
    if isinstance(_get(config, key), int):
        setattr(config, key, value)


def _set_rope_sections(config, family: str | None) -> None:
    """Multimodal rotary sections (``mrope_section``, read with a default sized for the
    checkpoint's heads) cut to the tiny head width."""
    rope = _get(config, "rope_parameters")
    if family is None or not isinstance(rope, dict):
        return
    spec = importlib.util.find_spec(f"transformers.models.{family}.modeling_{family}")
    with open(spec.origin, encoding="utf-8") as f:
        if "mrope_section" not in f.read():
            return
    head_dim = _get(config, "head_dim") or config.hidden_size // config.num_attention_heads
    n = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    spatial = (n - n // 4) // 2          # two equal spatial sections, the rest temporal
    rope["mrope_section"] = [spatial, spatial, n - 2 * spatial]


def _set_mamba(config) -> None:
    """Mamba heads that divide the tiny width (a derived head size is derived again)."""
    if isinstance(_get(config, "mamba_n_heads"), int):
        config.mamba_n_heads = 4
        expand = _get(config, "mamba_expand") or 2
        if isinstance(_get(config, "mamba_d_head"), int):
            config.mamba_d_head = expand * config.hidden_size // 4


def shrink(config, family: str | None = None):
    """Cut ``config`` (a transformers text config, changed in place) down to test size: hidden
    64, 8 experts top-2, vocabulary 128, a few layers covering every layer kind, every layer
    past the dense prefix an MoE layer. Returns it."""
    for key, value in _SIZES.items():
        _set_int(config, key, value)
    for key, value in _WHEN_NONE.items():
        if hasattr(config, key) and _get(config, key) is None:
            setattr(config, key, value)
    for key, value in _OVERRIDES.get(family, {}).items():
        setattr(config, key, value)
    for key in [k for k in vars(config) if k.endswith("_layer_period")]:
        _set_int(config, key, 2)
    for key in [k for k in vars(config) if k.endswith("_layer_offset")]:
        _set_int(config, key, 1)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    _set_rope_sections(config, family)
    _set_mamba(config)
    if not hasattr(config, "qk_rope_head_dim"):        # multi-head latent attention: as is
        if "head_dim" in vars(config) and vars(config)["head_dim"] is None:
            config.head_dim = 16
        _set_int(config, "head_dim", 16)
        _set_int(config, "num_key_value_heads", 2)
    else:
        _set_int(config, "num_key_value_heads", 4)
    for key in _EXPERTS:
        if hasattr(config, key):
            setattr(config, key, 8)
    for key in _TOP_K:
        if hasattr(config, key):
            setattr(config, key, 2)
    for key in _FLAGS_ON:
        if hasattr(config, key):
            setattr(config, key, True)
    for key in _ZERO:
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, 0)
    for key in _ONE:
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, 1)
    layers = getattr(config, "num_hidden_layers", None)
    if hasattr(config, "mlp_layer_types") and _get(config, "mlp_layer_types") is None:
        config.mlp_layer_types = ["sparse"] * layers
    if hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = []
    if hasattr(config, "vocab_size"):
        config.vocab_size = VOCAB
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token = getattr(config, key, None)
        if isinstance(token, int) and token >= VOCAB:
            setattr(config, key, VOCAB - 1 - ("pad", "bos", "eos").index(key[:3]))
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int):
        lists = _per_layer_lists(config, layers)
        keep = _keep_layers(lists, layers)
        for key, values in lists.items():
            setattr(config, key, [values[i] for i in keep])
        config.num_hidden_layers = len(keep)
        if hasattr(config, "max_window_layers"):
            config.max_window_layers = len(keep)
    return config


def tiny_model(family: str, implementation: str, seed: int = 0, *, expert_scale: float = 4.0):
    """``family``'s tiny model (:func:`shrink`), float32 on the CPU, with random weights drawn
    from ``seed``, experts run by ``implementation``. Routers that start at zero get random
    weights; the expert weights are multiplied by ``expert_scale`` so that the experts' share
    of the output is large."""
    from transformers import AutoConfig  # noqa: F401 - registers the auto classes

    cls = model_class(family)
    config = shrink(cls.config_class(), family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(config, experts_implementation=implementation,
                                 dtype=torch.float32)
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "has_gate") and hasattr(module, "num_experts"):
                    for _, p in module.named_parameters(recurse=False):
                        p.normal_(0.0, 0.02 * expert_scale)
            for _, p in model.named_parameters():
                if p.dim() == 2 and p.abs().sum() == 0:
                    p.normal_(0.0, 0.5)
    return model.float().eval()
