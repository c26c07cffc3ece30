"""What one HybridSpec generate() call may ask for (checked after generate() merged its defaults), and the
output it returns. Used by the generate() wrapper (integration.py) and the decode loop (loop.py)."""
from __future__ import annotations

import dataclasses

import torch
from transformers.generation import logits_process
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hybridspec_hf.graphs.capture import host_syncs
from hybridspec_hf.patches._cache import sync_linear_lengths

_STATELESS_PROCESSORS = {
    getattr(logits_process, name)
    for name in (
        "EpsilonLogitsWarper", "EtaLogitsWarper", "ExponentialDecayLengthPenalty", "ForcedBOSTokenLogitsProcessor",
        "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor", "LogitNormalization",
        "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "MinPLogitsWarper",
        "NoBadWordsLogitsProcessor", "NoRepeatNGramLogitsProcessor", "PrefixConstrainedLogitsProcessor",
        "RepetitionPenaltyLogitsProcessor", "SequenceBiasLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
        "SuppressTokensLogitsProcessor", "TemperatureLogitsWarper", "TopHLogitsWarper", "TopKLogitsWarper",
        "TopPLogitsWarper", "TypicalLogitsWarper",
        "WatermarkLogitsProcessor",  # its generator is reseeded from the prefix at every call
        # the prompt's rows, fixed at construction (batched rows see their own: generation/batched.row_processors)
        "EncoderNoRepeatNGramLogitsProcessor", "EncoderRepetitionPenaltyLogitsProcessor",
    )
    if hasattr(logits_process, name)
}
# The subset that reads only the scores of its own row (no prefix, no length): GPU-resident rounds apply them to
# all verified positions at once inside a graph; the others run the eager loop.
ROW_WISE_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                       "EpsilonLogitsWarper", "EtaLogitsWarper", "TypicalLogitsWarper")
_PROCESSOR_ADVICE = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "it runs the model on a cache of its own at every call; "
    "leave guidance_scale at 1 (classifier-free guidance is not supported)",
}


def check_prompt(model, input_ids: torch.Tensor) -> None:
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}.")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be integer token ids (torch.long), got dtype {input_ids.dtype}.")
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: HybridSpec needs at least one prompt token (e.g. a BOS token).")
    vocab = model.get_input_embeddings().weight.shape[0]
    with host_syncs():  # the call's set-up: one read of the prompt's range
        if input_ids.numel() and not bool(((input_ids >= 0) & (input_ids < vocab)).all()):
            raise ValueError(
                f"input_ids must be token ids in 0..{vocab - 1} (the model's vocabulary); got values from "
                f"{int(input_ids.min())} to {int(input_ids.max())}."
            )
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and input_ids.shape[1] >= limit:
        raise ValueError(
            f"The prompt has {input_ids.shape[1]} tokens but the model's limit (max_position_embeddings) is {limit}; "
            "shorten the prompt."
        )


_STATIC = "generation_strategy='static' with HybridSpecConfig(static_length=...)"
# Knobs of transformers' own assisted decoding, with the value generate() fills in when nobody set them (5.17-5.25):
# HybridSpec's rounds have their own, so a different value would otherwise be ignored.
_ASSISTED_KNOBS = {
    "num_assistant_tokens": (20, "HybridSpec drafts the drafter's whole block and chooses the tokens verified per "
                             f"round; for a fixed length use {_STATIC}"),
    "num_assistant_tokens_schedule": ("constant", f"HybridSpec's length rules are its strategies; for a fixed length "
                                      f"use {_STATIC}"),
    "assistant_confidence_threshold": (0.4, "use generation_strategy='confidence' with "
                                       "HybridSpecConfig(confidence_threshold=...)"),
    "assistant_lookbehind": (10, "the DFlash drafter shares the target's tokenizer"),
    "target_lookbehind": (10, "the DFlash drafter shares the target's tokenizer"),
    "max_matching_ngram_size": (None, "prompt lookup is a different drafter"),
}


def check_generation_config(model, generation_config, input_ids: torch.Tensor, model_kwargs: dict) -> bool:
    """Reject what the loop does not support, after generate() merged the model's defaults. Returns whether the
    attention mask has (left) padding."""
    problems = []
    if generation_config.num_beams not in (None, 1):
        problems.append(f"num_beams={generation_config.num_beams} (beam search): use num_beams=1")
    mode = generation_config.get_generation_mode().value  # the decoding method the options ask for, without a drafter
    if mode not in ("greedy_search", "sample", "beam_search", "beam_sample"):  # beams: refused above
        asked = {"contrastive_search": f"penalty_alpha={generation_config.penalty_alpha} with top_k="
                                       f"{generation_config.top_k}",
                 "dola_generation": f"dola_layers={getattr(generation_config, 'dola_layers', None)!r}",
                 "constrained_beam_search": "constraints/force_words_ids",
                 "assisted_generation": "prompt_lookup_num_tokens/assistant_early_exit/use_mtp"}.get(mode, "options")
        problems.append(f"{asked} ({mode.replace('_', ' ')}): HybridSpec decodes greedily or by sampling; leave "
                        "that method's options unset")
    for name, (default, advice) in _ASSISTED_KNOBS.items():
        value = getattr(generation_config, name, default)
        if value is not None and value != default:
            problems.append(f"{name}={value!r} (transformers' assisted decoding, which HybridSpec replaces: leave it "
                            f"at {default!r}): {advice}")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        problems.append("output_attentions/output_hidden_states: not recorded by HybridSpec rounds")
    if not model_kwargs.get("use_cache", True) or generation_config.use_cache is False:
        problems.append("use_cache=False: speculative decoding needs the cache; pass use_cache=True")
    if generation_config.cache_implementation not in (None, "dynamic", "static"):
        problems.append(f"cache_implementation={generation_config.cache_implementation!r}: use None (dynamic) or 'static'")
    mask = model_kwargs.get("attention_mask")
    with host_syncs():  # a per-call check, allowed to read the mask on the host
        padded = mask is not None and not bool((mask == 1).all())
        left = not padded or bool(((mask == 0) | (mask == 1)).all() and (mask[:, 1:] >= mask[:, :-1]).all()
                                  and (mask[:, -1] == 1).all())
    if not left:
        problems.append(
            "attention_mask has padding that is not left padding (zeros only before each row's tokens, the last "
            "column all ones; without an attention_mask, generate() infers it from prompt tokens equal to "
            "pad_token_id): pad on the left (tokenizer.padding_side = 'left'), or pass "
            "attention_mask=torch.ones_like(input_ids) if those are real tokens"
        )
    if problems:
        raise ValueError("Unsupported generation options for HybridSpec: " + "; ".join(problems) + ".")
    check_prompt(model, input_ids)  # again: generate() may have expanded it (beams, return sequences)
    return padded


def check_logits_processors(logits_processor) -> None:
    """Accept only processors known to be stateless (see _STATELESS_PROCESSORS), or marked so by their author."""
    for processor in logits_processor:
        if type(processor) in _STATELESS_PROCESSORS or getattr(processor, "hybridspec_stateless", False):
            continue
        name = type(processor).__name__
        why = _PROCESSOR_ADVICE.get(
            name,
            "HybridSpec calls each logits processor once per verified position, also on drafts that are then "
            "rejected, so only processors whose output depends on (input_ids, scores) alone keep AR's output. "
            f"If that holds for yours, set `{name}.hybridspec_stateless = True`; otherwise generate without "
            "generation_strategy",
        )
        raise ValueError(f"Logits processor {name} is not supported with HybridSpec: {why}.")


def finish_output(generation_config, emitter, cache, cache_key: str):
    """The call's output (generate()'s: the sequences, or a GenerateDecoderOnlyOutput), its cache's GDN token counts
    set to the tokens it holds (the cache is the caller's when they passed one). A static cache's length is on the
    device: reading it is the call's last allowed sync."""
    with host_syncs():
        sync_linear_lengths(cache)
    if not generation_config.return_dict_in_generate:
        return emitter.input_ids
    fields = {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
    cache_field = "cache" if "cache" in fields else "past_key_values"
    return GenerateDecoderOnlyOutput(
        sequences=emitter.input_ids,
        scores=tuple(emitter.scores) if emitter.scores is not None else None,
        logits=tuple(emitter.logits) if emitter.logits is not None else None,
        **{cache_field: cache},
    )
