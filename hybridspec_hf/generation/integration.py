"""generate() integration: `generation_strategy=` routes to the HybridSpec loop through `custom_generate`.

`enable()` wraps `generate` on the supported hybrid classes only. Without `generation_strategy` the original
generate runs untouched: its refusal of `assistant_model=` for stateful models (transformers < 5.25) with a note on
what to do, and from 5.25 on its own assisted decoding (per-token GDN states) with an ordinary assistant model. Our
DFlashDrafter without `generation_strategy` is refused here with what to pass: stock assisted decoding cannot run it.
"""
from __future__ import annotations

import copy
import functools

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

from hybridspec_hf import patches
from hybridspec_hf.config import STRATEGIES, HybridSpecConfig
from hybridspec_hf.generation.checks import check_prompt
from hybridspec_hf.generation.loop import hybridspec_decode
from hybridspec_hf.kernels import select_backend
from hybridspec_hf.kernels.gdn_triton import MAX_WINDOW

# generate() options the loop cannot honour; each gets a clear error instead of being ignored.
_UNSUPPORTED_KWARGS = {
    "custom_generate": "HybridSpec supplies its own decode loop",
    "prompt_lookup_num_tokens": "prompt lookup is a different drafter",
    "assistant_early_exit": "early-exit drafting is a different drafter",
    "use_mtp": "MTP drafting is a different drafter",
    "assistant_tokenizer": "the DFlash drafter shares the target's tokenizer",
    "inputs_embeds": "pass input_ids",
    "negative_prompt_ids": "classifier-free guidance needs a second sequence",
}

# Logits processors whose output depends only on (input_ids, scores) and their constructor arguments: the loop calls
# them once per verified position with speculative prefixes, in any order, so a processor with state of its own (or
# one that runs a model, like classifier-free guidance) would see rejected drafts. Exact classes only: a subclass
# may add state.
def _hybridspec_generate(original, self, *args, generation_strategy=None, hybridspec_config=None, **kwargs):
    if generation_strategy is None:
        if hybridspec_config is not None:
            raise ValueError("hybridspec_config= was given without generation_strategy=; add e.g. generation_strategy='hybridspec'.")
        if kwargs.get("assistant_model") is None:
            return original(self, *args, **kwargs)
        from hybridspec_hf.drafter import DFlashDrafter

        if isinstance(kwargs["assistant_model"], DFlashDrafter):  # stock assisted decoding cannot run it
            raise ValueError(
                "assistant_model= is a hybridspec_hf.DFlashDrafter, which drafts from the target's hidden states "
                "inside HybridSpec's loop only; transformers' own assisted decoding cannot run it. Pass "
                f"generation_strategy='hybridspec' (or one of {', '.join(repr(s) for s in STRATEGIES[1:])}) "
                "together with assistant_model=."
            )
        try:
            return original(self, *args, **kwargs)
        except ValueError as error:  # transformers' refusal stays as raised; the note says what to do instead
            if "stateful" in str(error):
                error.add_note(
                    "hybridspec_hf: stock assisted decoding cannot roll back the Gated-DeltaNet state. For speculative "
                    "decoding with a hybridspec_hf.DFlashDrafter pass generation_strategy='hybridspec' (or one of "
                    f"{', '.join(repr(s) for s in STRATEGIES[1:])}) together with assistant_model=."
                )
            raise
    if generation_strategy not in STRATEGIES:
        raise ValueError(f"generation_strategy must be one of {STRATEGIES}, got {generation_strategy!r}.")
    settings = HybridSpecConfig() if hybridspec_config is None else hybridspec_config
    if not isinstance(settings, HybridSpecConfig):
        raise TypeError(f"hybridspec_config must be a hybridspec_hf.HybridSpecConfig, got {type(settings).__name__}.")
    # given as keywords, or in the generation config (generate() acts on some before the decoding loop runs)
    config = kwargs.get("generation_config", args[1] if len(args) > 1 else None) or self.generation_config
    for key, why in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(key, getattr(config, key, None)) is not None:
            raise ValueError(f"generate(..., {key}=...) is not supported with generation_strategy={generation_strategy!r}: {why}.")
    if kwargs.get("synced_gpus"):  # generate() does not pass it to a custom_generate callable: it would be ignored
        raise ValueError(
            "generate(..., synced_gpus=True) (DeepSpeed ZeRO-3 / FSDP) is not supported with HybridSpec; "
            "use tp_plan='auto' to spread the target over several GPUs."
        )
    # more that generate() acts on before the decoding loop runs (checks.check_generation_config sees the rest)
    implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
    if implementation not in (None, "dynamic", "static"):  # generate() builds it first: an offloaded one needs a stream
        raise ValueError(
            f"Unsupported generation options for HybridSpec: cache_implementation={implementation!r}: use None "
            "(dynamic) or 'static'."
        )
    if kwargs.get("token_healing", getattr(config, "token_healing", None)):  # generate() heals before our loop runs
        raise ValueError(
            f"generate(..., token_healing=True) is not supported with generation_strategy={generation_strategy!r} "
            "(generate() does not pass the tokenizer on to it): heal the prompt first, "
            "model.heal_tokens(input_ids, tokenizer=tokenizer), and pass the healed ids."
        )
    drafter = kwargs.pop("assistant_model", None)
    _check_drafter(self, drafter, generation_strategy)
    _check_block_size(self, drafter, settings)
    _move_stop_strings_to_criteria(config, args, kwargs)
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(inputs, torch.Tensor):
        check_prompt(self, inputs)
    home = inputs.device if isinstance(inputs, torch.Tensor) else None
    args = place_inputs(args, kwargs, self.get_input_embeddings().weight.device)
    output = original(
        self,
        *args,
        custom_generate=hybridspec_decode,
        hybridspec_drafter=drafter,
        hybridspec_streamer=kwargs.pop("streamer", None),
        hybridspec_strategy=generation_strategy,
        hybridspec_settings=settings,
        **kwargs,
    )
    return output if home is None else return_to(output, home)


def place_inputs(args: tuple, kwargs: dict, device: torch.device) -> tuple:
    """The prompt's tensors (the positional input and every tensor keyword: input_ids, attention_mask, ...) on
    `device`, the input embedding's; kwargs are updated in place, the new positional args returned.

    Stock generate() takes a prompt on another device than the model (a CPU prompt for a model on a GPU, or under
    tensor parallelism, where each rank's shards sit on its own GPU): it moves the forward's inputs to the model
    right before each call and keeps its bookkeeping where the prompt is. HybridSpec's rounds keep everything on
    the device, so the prompt moves once, here, and `return_to` brings the output back to where it came from."""
    def moved(value):
        return value.to(device) if isinstance(value, torch.Tensor) else value

    for key, value in kwargs.items():
        kwargs[key] = moved(value)
    return tuple(moved(value) for value in args[:1]) + tuple(args[1:])


def return_to(output, device: torch.device):
    """generate()'s output (sequences, or a GenerateDecoderOnlyOutput with its sequences, scores and logits) on
    `device`, where the prompt was, as stock generate() returns it; the cache stays beside the model."""
    if isinstance(output, torch.Tensor):
        return output.to(device)
    output.sequences = output.sequences.to(device)
    for name in ("scores", "logits"):
        rows = getattr(output, name, None)
        if rows is not None:
            setattr(output, name, tuple(row.to(device) for row in rows))
    return output


def _move_stop_strings_to_criteria(config, args, kwargs) -> None:
    """generate() drops `tokenizer` when a custom_generate callable is used, so stop strings would fail there:
    build their StopStringCriteria here and pass it with the user's stopping criteria. config: the call's generation
    config (the model's where none was passed)."""
    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = kwargs.pop("stop_strings", None)
    if stop_strings is None:
        stop_strings = getattr(config, "stop_strings", None)
        if stop_strings is not None:
            config = copy.deepcopy(config)
            config.stop_strings = None
            if len(args) > 1:
                raise ValueError("Pass generation_config= by keyword together with stop strings and HybridSpec.")
            kwargs["generation_config"] = config
    if stop_strings is None:
        return
    if tokenizer is None:
        raise ValueError(
            "There are one or more stop strings, but no tokenizer: pass the model's tokenizer as generate(..., tokenizer=...)."
        )
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria


def _check_drafter(target, drafter, strategy: str) -> None:
    from hybridspec_hf.drafter import DFlashDrafter

    if drafter is None and strategy == "ar":
        return
    if drafter is None:
        raise ValueError(
            f"generation_strategy={strategy!r} needs a drafter: pass assistant_model=DFlashDrafter "
            "(DFlashDrafter.from_pretrained(...) or DFlashDrafter.from_target(target))."
        )
    if not isinstance(drafter, DFlashDrafter):
        raise TypeError(f"assistant_model must be a hybridspec_hf.DFlashDrafter for HybridSpec, got {type(drafter).__name__}.")
    drafter.validate_target(target)


def _check_block_size(target, drafter, settings: HybridSpecConfig) -> None:
    """A block is the anchor plus at least one mask; the Triton GDN verify takes at most MAX_WINDOW tokens."""
    if drafter is None:  # "ar": no drafting
        return
    block_size = drafter.config.block_size
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(
            f"The drafter's block_size={block_size!r}: a block is the anchor plus at least one draft, so it must be "
            "an int ≥ 2 (z-lab's DFlash drafters use 16)."
        )
    backend = select_backend(settings.kernel_backend, next(target.parameters()))
    if backend == "triton" and block_size > MAX_WINDOW:
        raise ValueError(
            f"The drafter's block_size={block_size} is larger than the Triton GDN verify takes (at most {MAX_WINDOW} "
            'tokens per round); use a drafter with block_size ≤ 16, or kernel_backend="torch".'
        )


def enable() -> None:
    """Install verify mode on the GDN layers and the generate() wrapper on the hybrid classes (idempotent).

    GenerationMixin.generate gets a guard that only acts when `generation_strategy=` is passed to a model that
    HybridSpec does not support (a clear error instead of transformers' "model_kwargs are not used").
    """
    patches.install()
    _guard_unsupported_models()
    for cls in patches.supported_classes():
        if "_hybridspec_original_generate" in cls.__dict__:
            continue
        original = cls.generate
        cls._hybridspec_original_generate = original
        cls.generate = _as_method(original)


def _guard_unsupported_models() -> None:
    from transformers.generation.utils import GenerationMixin

    if "_hybridspec_original_generate" in GenerationMixin.__dict__:
        return
    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if kwargs.get("generation_strategy") is not None:
            patches.family_of(self)  # raises: supported classes have their own wrapper
        return original(self, *args, **kwargs)

    GenerationMixin._hybridspec_original_generate = original
    GenerationMixin.generate = generate


def _as_method(original):
    @functools.wraps(original)
    def generate(self, *args, generation_strategy=None, hybridspec_config=None, **kwargs):
        return _hybridspec_generate(
            original, self, *args, generation_strategy=generation_strategy, hybridspec_config=hybridspec_config, **kwargs
        )

    return generate


def get_telemetry(model):
    """The `GenerationTelemetry` of the model's last HybridSpec generate() call."""
    telemetry = getattr(model, "hybridspec_telemetry", None)
    if telemetry is None:
        raise ValueError("No HybridSpec telemetry on this model yet: call generate(..., generation_strategy=...) first.")
    return telemetry
