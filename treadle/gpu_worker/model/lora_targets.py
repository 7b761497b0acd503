"""Which parts of a loaded model a LoRA adapter trains, found from the model itself rather than from names.

`train_attn`, `train_mlp` and `train_unembed` (Tinker's LoraConfig) must mean the same on every family,
whatever its modules are called. So the targets are read off the decoder layers of the loaded model:

- **attention**: every `nn.Linear` inside a layer's token mixer: `q/k/v/o_proj` (Llama, Qwen, Gemma,
  gpt-oss), the fused `qkv_proj` (Phi-3), DeepSeek's latent projections (`q_a_proj`, `q_b_proj`,
  `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`), the projections of a linear-attention layer (Qwen3.5's
  gated delta net: `in_proj_qkv`, `in_proj_z`, `in_proj_a`, `in_proj_b`, `out_proj`), a Mamba-2 mixer's
  `in_proj` (Falcon-H1, Nemotron-H; not its `out_proj`, which the fused kernel reads directly);
- **mlp**: every `nn.Linear` inside a layer's feed-forward block (`gate/up/down_proj`, Phi-3's fused
  `gate_up_proj`, DeepSeek's shared experts), and every expert weight stored as one 3-D tensor
  (`experts.gate_up_proj` / `experts.down_proj`: Qwen3-MoE, gpt-oss, DeepSeek-V3), adapted through
  PEFT's `target_parameters`. Routers never are: a router decides which experts run, and adapting it
  would train the routing rather than the experts (Tinker adapts experts, not routers);
- **unembed**: the output projection (`lm_head`);
- **vision** (vision-language models): every `nn.Linear` of the vision tower and its projector, by full
  name. They are trained only when `LoraConfig.train_vision` asks; otherwise PEFT is told to leave them
  out (`exclude`), since a vision block's `mlp.gate_proj` would match the decoder's suffix.

Targets are suffixes relative to a decoder layer (`self_attn.q_proj`, `mlp.shared_experts.gate_proj`),
so they match every layer that has them and nothing outside the decoder stack.

Rank per expert: an expert tensor (E experts x in x out) gets A (r*E x in) and B (out x r*E), i.e. each
expert its own rank-r update, r*E*(in+out) parameters for the tensor (PEFT's `ParamWrapper`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from treadle.errors import InvalidRequestError

# A decoder layer's children are its token mixer, its feed-forward block and norms. Matched on the
# child's class name, then on its attribute name.
_ATTENTION = re.compile(r"attn|attention|mixer|mamba|linear_attn", re.IGNORECASE)
_FEED_FORWARD = re.compile(r"mlp|moe|ffn|feed_forward|experts", re.IGNORECASE)
# Routers and gates that weigh experts: a module or parameter named so, or a class named *Router.
_ROUTER = re.compile(r"(^|\.)(gate|router|shared_expert_gate|e_score_correction_bias)$")


@dataclass(frozen=True)
class LoraTargets:
    """The adaptable parts of one model, each as suffixes relative to a decoder layer (lm_head: absolute)."""

    attention: tuple[str, ...]
    mlp: tuple[str, ...]
    experts: tuple[str, ...]  # 3-D expert parameters (PEFT target_parameters)
    unembed: tuple[str, ...] = ("lm_head",)
    layers: int = 0
    notes: tuple[str, ...] = field(default=())
    vision: tuple[str, ...] = ()  # the vision tower's and projector's linears, full names

    def modules(self, *, attn: bool, mlp: bool, unembed: bool, vision: bool = False) -> list[str]:
        return [
            *(self.attention if attn else ()),
            *(self.mlp if mlp else ()),
            *(self.unembed if unembed else ()),
            *(self.vision if vision else ()),
        ]

    def exclude(self, *, vision: bool) -> list[str]:
        """Modules PEFT must not adapt: the vision tower's, unless asked for."""
        return [] if vision else list(self.vision)

    def parameters(self, *, mlp: bool) -> list[str]:
        return list(self.experts) if mlp else []


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: the ModuleList with one entry per hidden layer."""
    count = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    towers = vision_prefixes(model)
    candidates = [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) == count and not name.startswith(towers)
    ]
    if not candidates:
        raise InvalidRequestError(
            f"model: no stack of {count} decoder layers found in {type(model).__name__}; treadle cannot place LoRA adapters on it"
        )
    return candidates[0]


def find_targets(model: nn.Module) -> LoraTargets:
    """The LoRA targets of `model` (a causal LM), or an error naming what could not be classified."""
    attention: dict[str, None] = {}
    mlp: dict[str, None] = {}
    experts: dict[str, None] = {}
    layers = decoder_layers(model)
    for layer in layers:
        for child_name, child in layer.named_children():
            linears = [name for name, m in child.named_modules() if isinstance(m, nn.Linear) and name]
            # Expert stacks: 3-D weights of a model's own modules (a convolution's kernel is 3-D too).
            tensors = [
                name
                for name, p in child.named_parameters()
                if p.dim() == 3 and not isinstance(_owner(child, name), nn.modules.conv._ConvNd)
            ]
            if not linears and not tensors:
                continue  # norms, rotary embeddings
            kind = _kind(child_name, child)
            if kind is None:
                raise InvalidRequestError(
                    f"model: decoder layer part {child_name!r} ({type(child).__name__}) has weights but is neither "
                    "attention nor a feed-forward block; treadle does not know how to adapt it"
                )
            for name in linears:
                if _is_router(f"{child_name}.{name}", child.get_submodule(name)) or _fused_in_kernel(
                    child_name, child, name
                ):
                    continue
                (attention if kind == "attention" else mlp)[f"{child_name}.{name}"] = None
            for name in tensors:
                if _is_router(f"{child_name}.{name}", _owner(child, name)):
                    continue
                if kind != "mlp":
                    raise InvalidRequestError(f"model: a 3-D weight {child_name}.{name} outside a feed-forward block")
                experts[f"{child_name}.{name}"] = None
    unembed = ("lm_head",) if isinstance(getattr(model, "lm_head", None), nn.Linear) else ()
    towers = vision_prefixes(model)
    vision = tuple(
        name for name, m in model.named_modules() if isinstance(m, nn.Linear) and towers and name.startswith(towers)
    )
    return LoraTargets(
        attention=tuple(attention),
        mlp=tuple(mlp),
        experts=tuple(experts),
        unembed=unembed,
        layers=len(layers),
        vision=vision,
    )


# The vision tower and the projector into the decoder's width, as transformers names them: Qwen-VL's `visual`
# (its merger inside), Gemma 3's `vision_tower` and `multi_modal_projector`.
_VISION_PARTS = ("visual", "vision_tower", "multi_modal_projector")


def vision_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Module-name prefixes (with their trailing dot) of the model's vision tower and projector; () for a text model."""
    return tuple(f"{name}." for name, _ in model.named_modules() if name and name.rsplit(".", 1)[-1] in _VISION_PARTS)


def _owner(module: nn.Module, parameter_name: str) -> nn.Module:
    return module.get_submodule(parameter_name.rsplit(".", 1)[0]) if "." in parameter_name else module


def _kind(child_name: str, child: nn.Module) -> str | None:
    # The class name first: Nemotron-H calls every layer's block `mixer`, whether Mamba, attention or MLP.
    # Attention first: MoE models' attention classes carry "Moe" in their names (Qwen3MoeAttention).
    for text in (type(child).__name__, child_name):
        if _ATTENTION.search(text):
            return "attention"
        if _FEED_FORWARD.search(text):
            return "mlp"
    return None


def _fused_in_kernel(mixer_name: str, mixer: nn.Module, name: str) -> bool:
    """A Mamba mixer's fused CUDA kernel reads `out_proj.weight` itself, past any LoRA wrapper (PEFT refuses
    that target on Mamba models); the mixer's `in_proj` stays adaptable."""
    is_mamba = "mamba" in f"{mixer_name} {type(mixer).__name__}".lower()
    return is_mamba and name.rsplit(".", 1)[-1] == "out_proj"


def _is_router(path: str, module: nn.Module) -> bool:
    return bool(_ROUTER.search(path)) or "router" in type(module).__name__.lower()


def check_requested(
    targets: LoraTargets, *, attn: bool, mlp: bool, unembed: bool, model_name: str, vision: bool = False
) -> None:
    """Refuse a LoRA config that would train nothing on this model (e.g. train_unembed alone on a tied head), or
    asks for the vision tower of a model without one."""
    if vision and not targets.vision:
        raise InvalidRequestError(f"lora: train_vision=True, but {model_name} has no vision tower")
    if not targets.modules(attn=attn, mlp=mlp, unembed=unembed) and not targets.parameters(mlp=mlp):
        raise InvalidRequestError(
            f"lora: train_attn={attn}, train_mlp={mlp}, train_unembed={unembed} selects no weights of {model_name}"
        )
