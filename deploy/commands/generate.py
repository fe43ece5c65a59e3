"""`knot generate MODEL "prompt"`: run the whole model in this process and stream the text."""
from __future__ import annotations

import argparse
import json
import sys
import time

from common.sampling import SamplingParams

NAME = "generate"
HELP = ("generate text from a .gguf or .knot (or a named model) in one process; "
        "greedy by default (--temperature 0), so the output is reproducible")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path to a .gguf or .knot, or a model name known to `knot fetch-model`")
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N",
                   help="tokens to generate (default 128; fewer where the context ends first)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, the default: deterministic and comparable with llama.cpp")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= min_p * p_max (0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler (same seed, same output)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit before sampling (repeatable; -100 all but bans it)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message")
    p.add_argument("--suffix", default=None, metavar="TEXT",
                   help="fill in the middle: write what goes between the prompt and TEXT (the model's "
                        "<|fim_prefix|>, <|fim_suffix|> and <|fim_middle|>; both texts stay plain text)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable); TEXT is not printed")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (prompt ids, generated ids, text, finish_reason \"stop\" or "
                        "\"length\" as in the OpenAI API, timings) instead of streaming")
    p.add_argument("--stats", action="store_true", help="print prefill and decode tok/s to stderr")
    p.add_argument("--no-weight-cache", action="store_true",
                   help="do not keep copies of the weights (float32 ones where no kernel takes the type, "
                        "huge-page ones where one does): slower, less memory")


# The API's field -> this command's flag, where they are spelt differently
FLAGS = {"repetition_penalty": "--repeat-penalty"}


def checked_request(args: argparse.Namespace) -> tuple[SamplingParams, int, tuple[str, ...]]:
    """The sampling flags, --max-tokens and --stop, through the API's own checks (the same ranges
    and messages as a 400 of the coordinator's), so a value the API refuses is not run here."""
    from services.coordinator.errors import InvalidParam
    from services.coordinator.params import number, sampling_params, stop_strings

    body = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "repetition_penalty": args.repeat_penalty, "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty, "seed": args.seed, "max_tokens": args.max_tokens,
            "stop": args.stop, "logit_bias": {}}
    for item in args.logit_bias:
        tid, sep, bias = (part.strip() for part in item.partition("="))
        if tid in body["logit_bias"]:
            raise ValueError(f"--logit-bias: token {tid} is given twice")
        try:
            body["logit_bias"][tid] = float(bias) if sep else None
        except ValueError:
            body["logit_bias"][tid] = bias  # not a number: the check below names it
    try:
        # (no default: the flag always has a value, 128 as the API's DEFAULT_MAX_TOKENS)
        return (sampling_params(body), number(body, "max_tokens", None, lo=1, integer=True), stop_strings(body))
    except InvalidParam as e:
        flag = FLAGS.get(e.param or "", f"--{(e.param or '').replace('_', '-')}")
        raise ValueError(f"{flag}: {e}") from None


def run(args: argparse.Namespace) -> int:
    from common.tokenizer import TokenizerError
    from deploy.engine_local import LocalEngine
    from deploy.models import model_path

    params, max_tokens, stop = checked_request(args)
    if args.system is not None and not args.chat:
        raise ValueError("--system is a chat's system message: add --chat (without it the prompt is plain text)")
    if args.suffix is not None and args.chat:
        raise ValueError("--suffix fills in the middle of a plain-text prompt: drop --chat")
    t0 = time.perf_counter()
    engine = LocalEngine.open(model_path(args.model), cache_f32=False if args.no_weight_cache else None,
                              copy_weights=not args.no_weight_cache)
    engine.load_weights()  # before the prompt, so that --stats gives the prefill's own time
    tok = engine.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
        body_ids = tok.encode_chat(messages, add_generation_prompt=True)  # contents stay text
    elif args.suffix is not None:
        try:
            body_ids = tok.encode_fim(args.prompt, args.suffix)
        except TokenizerError as e:
            raise ValueError(f"--suffix: {e}") from None
    else:
        body_ids = tok.encode(args.prompt)
    prompt_ids = ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + body_ids
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    if len(prompt_ids) >= engine.cfg.context_length:
        raise ValueError(f"the prompt is {len(prompt_ids)} tokens and the context length "
                         f"{engine.cfg.context_length}: no room for a completion; shorten the prompt")
    outside = [t for t, _ in params.logit_bias if t >= engine.cfg.vocab_size]
    if outside:
        raise ValueError(f"--logit-bias: token {outside[0]} is outside the vocabulary [0, {engine.cfg.vocab_size})")
    load_s = time.perf_counter() - t0

    def on_text(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    gen = engine.generate(prompt_ids, params, max_tokens=max_tokens, stop=stop,
                          on_text=None if args.json else on_text)
    if args.json:
        print(json.dumps({
            "prompt_token_ids": gen.prompt_ids,
            "token_ids": gen.token_ids,
            "text": gen.text,
            "finish_reason": gen.finish_reason,
            "timings": {"load_s": round(load_s, 4), "prefill_s": round(gen.prefill_s, 4),
                        "decode_s": round(gen.decode_s, 4),
                        "prefill_tok_s": round(gen.prefill_tok_s, 2), "decode_tok_s": round(gen.decode_tok_s, 2)},
        }, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if args.stats:
        print(f"prompt {len(gen.prompt_ids)} tokens: prefill {gen.prefill_s:.2f} s, {gen.prefill_tok_s:.1f} tok/s; "
              f"generated {len(gen.token_ids)} tokens: decode {gen.decode_s:.2f} s, {gen.decode_tok_s:.2f} tok/s "
              f"(finish: {gen.finish_reason})", file=sys.stderr)
    return 0
