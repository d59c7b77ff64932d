"""`gemmactl run`'s generation core vs raw llama-cpp-python, side by side, on the same GGUF.

Both sides load the same file with the same settings (context, threads, greedy, same prompt,
same token count) and are timed by this script in the same way, interleaved A B A B:
  wall tok/s   = generated tokens ÷ (request start → last token)   what a caller waits for
  decode tok/s = (generated tokens − 1) ÷ (first token → last token) decode only
It also times `gemmactl --help` (a fresh process each time) and, for reference, raw
llama-cpp-python with its own default thread count.

    python benchmarks/run_vs_llamacpp.py [--model GGUF] [--tokens 128] [--repeats 7] [--out FILE]

--model defaults to the embedded Gemma 3 270M of the store ($GEMMACTL_HOME, else gemmactl's
default store). The JSON report goes to stdout and, with --out, to FILE. Needs llama-cpp-python
and `gemmactl` on PATH (for the --help timing).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "The history of the city of Paris begins"


def time_stream(events) -> dict:
    """Time an iterator of streamed events: request start, first and last event."""
    start = time.perf_counter()
    first = last = None
    for _ in events:
        last = time.perf_counter()
        first = first or last
    return {"ttft_s": first - start, "wall_s": last - start, "decode_s": last - first}


def rates(sample: dict, tokens: int) -> dict:
    return {
        "wall_tok_s": tokens / sample["wall_s"],
        "decode_tok_s": (tokens - 1) / sample["decode_s"],
        "ttft_s": sample["ttft_s"],
    }


def gemmactl_events(backend, request, text: list[str]):
    """gemmactl's streaming core, exactly as `run` consumes it."""
    from gemmactl.runtime.base import GenerationStats, stream_generate

    for event in stream_generate(backend, request):
        if isinstance(event, GenerationStats):
            if event.generated_tokens != request.max_tokens:
                raise SystemExit(f"gemmactl stopped after {event.generated_tokens} tokens; pick another prompt")
        else:
            text.append(event.text)
        yield event


def raw_events(llm, tokens: int, text: list[str]):
    """llama-cpp-python's own streaming completion."""
    llm.reset()  # same clean start as gemmactl (see runtime/llamacpp.py)
    for chunk in llm.create_completion(PROMPT, max_tokens=tokens, temperature=0, stream=True):
        choice = chunk["choices"][0]
        text.append(choice["text"])
        if choice.get("finish_reason") not in (None, "length"):
            raise SystemExit(f"llama-cpp-python stopped early ({choice['finish_reason']}); pick another prompt")
        yield chunk


def help_times(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(["gemmactl", "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def summary(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF to use (default: the embedded Gemma 3 270M)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args()

    import llama_cpp

    from gemmactl.store.embedded import ensure_embedded_model
    from gemmactl.runtime.base import GenerationRequest
    from gemmactl.runtime.llamacpp import LlamaCppBackend, override_model_params, default_threads, use_extra_buffers
    from gemmactl.store import Store

    model = args.model or ensure_embedded_model(Store()).path
    threads = default_threads()
    extra = use_extra_buffers()
    ours = LlamaCppBackend(model, context_size=args.context, n_threads=threads)

    def load_raw(**kwargs):
        # Same extra-buffer setting as gemmactl: the library's default segfaults on AMX CPUs.
        with override_model_params(llama_cpp, use_extra_bufts=extra):
            return llama_cpp.Llama(model_path=model, n_ctx=args.context, n_gpu_layers=-1, verbose=False, **kwargs)

    raw = load_raw(n_threads=threads, n_threads_batch=threads)
    raw_default_threads = load_raw()

    # Greedy, with the filters spelled out (the values GenerationRequest defaulted to when the
    # recorded figures were made): temperature 0 takes the argmax whatever they keep.
    request = GenerationRequest(prompt=PROMPT, max_tokens=args.tokens, temperature=0, top_k=40, top_p=0.95,
                                min_p=0.0, repeat_penalty=1.0, raw=True)
    rows = {"gemmactl": [], "raw": [], "raw_default_threads": []}
    texts = {"gemmactl": [], "raw": [], "raw_default_threads": []}
    for _ in range(args.repeats):  # interleaved: A B A B ...
        ours_text, raw_text = [], []
        rows["gemmactl"].append(rates(time_stream(gemmactl_events(ours, request, ours_text)), args.tokens))
        rows["raw"].append(rates(time_stream(raw_events(raw, args.tokens, raw_text)), args.tokens))
        texts["gemmactl"].append("".join(ours_text))
        texts["raw"].append("".join(raw_text))
    for _ in range(max(2, args.repeats // 2)):
        rows["raw_default_threads"].append(rates(time_stream(raw_events(raw_default_threads, args.tokens, [])), args.tokens))

    ratios = {
        key: [a[key] / b[key] for a, b in zip(rows["gemmactl"], rows["raw"])] for key in ("wall_tok_s", "decode_tok_s")
    }
    result = {
        "model": str(model),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "threads": threads,
        "raw_default_thread_count": raw_default_threads.context_params.n_threads,
        "extra_buffers": extra,
        "cpu": platform.processor() or platform.machine(),
        "llama_cpp_python": llama_cpp.__version__,
        # Same greedy text on both sides in every repeat, or the comparison means nothing.
        "same_text": len(set(texts["gemmactl"] + texts["raw"])) == 1,
        "gemmactl": {k: summary([r[k] for r in rows["gemmactl"]]) for k in ("wall_tok_s", "decode_tok_s", "ttft_s")},
        "raw": {k: summary([r[k] for r in rows["raw"]]) for k in ("wall_tok_s", "decode_tok_s", "ttft_s")},
        "raw_default_threads": {k: summary([r[k] for r in rows["raw_default_threads"]]) for k in ("wall_tok_s", "decode_tok_s")},
        "ratio_gemmactl_over_raw": {k: summary(v) for k, v in ratios.items()},
        "help_s": summary(help_times(args.repeats)),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
