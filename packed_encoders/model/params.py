"""`ModernBertParams`: the static facts of a ModernBERT config that the packed forward needs.

Both config layouts are read: transformers v5 (`layer_types`, `rope_parameters`) and v4
(`global_attn_every_n_layers`, `global_rope_theta`, `local_rope_theta`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("modernbert", "mmbert")

# HF `hidden_activation` names -> the activation the GLU applies to its first half.
# "gelu" is the exact erf form; "gelu_pytorch_tanh"/"gelu_new" are the tanh approximation.
_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
}


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class ModernBertParams:
    """Static, hashable facts about a ModernBERT encoder (no tensors).

    Attributes:
        hidden_size: H, width of the residual stream.
        num_attention_heads: number of heads; ``head_dim = hidden_size // num_attention_heads``.
        intermediate_size: I; ``Wi`` maps H -> 2I (GLU input and gate), ``mlp.Wo`` maps I -> H.
        layer_is_global: per layer, True for ``"full_attention"``, False for ``"sliding_attention"``.
        local_attention: HF's total local window; a local layer attends ``|i - j| <= local_attention // 2``.
        rope_theta_global / rope_theta_local: RoPE base per layer type (split-half convention).
        activation: one of ``"gelu"`` (erf), ``"gelu_tanh"``, ``"silu"``, ``"relu"``.
    """

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    activation: str
    layer_is_global: tuple[bool, ...]
    local_attention: int
    rope_theta_global: float
    rope_theta_local: float
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    mlp_dropout: float = 0.0
    model_type: str = "modernbert"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def scaling(self) -> float:
        """Softmax scale, ``head_dim ** -0.5`` (as HF ModernBertAttention)."""
        return self.head_dim ** -0.5

    @property
    def window(self) -> int:
        """Half window of local layers: a query at i sees keys j with ``|i - j| <= window``."""
        return self.local_attention // 2

    def layer_window(self, layer: int) -> int | None:
        """``None`` for a global layer, else the half window."""
        return None if self.layer_is_global[layer] else self.window

    def attention_dropout_of(self, attn) -> float:
        """The attention-probability dropout rate stock HF applies in ``attn``'s (a layer's attention module) next
        call: 0 in eval mode, else ``attn.attention_dropout`` read live, as stock reads it per call (the config's
        value at ``pack()`` when the module has none)."""
        return getattr(attn, "attention_dropout", self.attention_dropout) if attn.training else 0.0

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModernBertParams":
        """Read a ModernBERT config (v4 or v5 layout, object or dict).

        Raises:
            ValueError: unsupported ``model_type``, ``hidden_size`` not divisible by the head count, an odd
                ``head_dim``, a RoPE type other than ``"default"``, an activation the path does not implement,
                or a ``head_dim`` override that disagrees with ``hidden_size // num_attention_heads``.
        """
        model_type = _get(config, "model_type", "modernbert")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not a ModernBERT encoder (supported: {SUPPORTED_MODEL_TYPES})"
            )
        hidden = int(_get(config, "hidden_size"))
        heads = int(_get(config, "num_attention_heads"))
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        if (hidden // heads) % 2:
            # RoPE rotates dims d and d + head_dim / 2 of each head; stock HF breaks on an odd head_dim too
            # (a shape error, or for head_dim 1 a broadcast to two dims that is not attention)
            raise ValueError(f"head_dim {hidden // heads} (hidden_size {hidden} / num_attention_heads {heads}) is "
                             "odd: rotary embeddings need an even head_dim")
        head_dim_override = _get(config, "head_dim")
        if head_dim_override not in (None, hidden // heads):
            raise ValueError(
                f"config.head_dim={head_dim_override} differs from hidden_size // num_attention_heads "
                f"= {hidden // heads}; ModernBERT's attention uses the latter"
            )
        layers = int(_get(config, "num_hidden_layers"))

        layer_types = _get(config, "layer_types")
        if layer_types is not None:
            if len(layer_types) != layers:
                raise ValueError(f"config.layer_types has {len(layer_types)} entries for {layers} layers")
            unknown = set(layer_types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise ValueError(f"unsupported layer_types {sorted(unknown)}")
            is_global = tuple(t == "full_attention" for t in layer_types)
        else:
            every = int(_get(config, "global_attn_every_n_layers", 3))
            is_global = tuple(i % every == 0 for i in range(layers))

        theta_global, theta_local = _read_rope_thetas(config)

        act_name = _get(config, "hidden_activation", "gelu")
        if act_name not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_activation {act_name!r} is not implemented by the packed path "
                f"(supported: {sorted(_ACTIVATIONS)})"
            )
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_hidden_layers=layers,
            intermediate_size=int(_get(config, "intermediate_size")),
            vocab_size=int(_get(config, "vocab_size")),
            norm_eps=float(_get(config, "norm_eps", 1e-5)),
            norm_bias=bool(_get(config, "norm_bias", False)),
            attention_bias=bool(_get(config, "attention_bias", False)),
            mlp_bias=bool(_get(config, "mlp_bias", False)),
            activation=_ACTIVATIONS[act_name],
            layer_is_global=is_global,
            local_attention=int(_get(config, "local_attention", 128)),
            rope_theta_global=theta_global,
            rope_theta_local=theta_local,
            embedding_dropout=float(_get(config, "embedding_dropout", 0.0) or 0.0),
            attention_dropout=float(_get(config, "attention_dropout", 0.0) or 0.0),
            mlp_dropout=float(_get(config, "mlp_dropout", 0.0) or 0.0),
            model_type=model_type,
        )


def _read_rope_thetas(config: Any) -> tuple[float, float]:
    rope_parameters = _get(config, "rope_parameters")
    if isinstance(rope_parameters, dict) and (
        "full_attention" in rope_parameters or "sliding_attention" in rope_parameters
    ):
        out = []
        for key, default in (("full_attention", 160_000.0), ("sliding_attention", 10_000.0)):
            entry = rope_parameters.get(key) or {}
            rope_type = entry.get("rope_type", entry.get("type", "default"))
            if rope_type != "default":
                raise ValueError(
                    f"rope_parameters[{key!r}] has rope_type {rope_type!r}; only 'default' RoPE is implemented"
                )
            out.append(float(entry.get("rope_theta", default)))
        return out[0], out[1]
    scaling = _get(config, "rope_scaling")
    if scaling:
        raise ValueError(f"rope_scaling={scaling!r} is not implemented by the packed path")
    theta_global = _get(config, "global_rope_theta")
    if theta_global is None:
        theta_global = _get(config, "rope_theta", 160_000.0)
    missing = object()
    theta_local = _get(config, "local_rope_theta", missing)
    if theta_local is missing:  # the v4 and v5 default
        theta_local = 10_000.0
    elif theta_local is None:  # v4: local layers reuse the global theta when local_rope_theta is None
        theta_local = theta_global
    return float(theta_global), float(theta_local)
