"""`compilecore generate | chat | serve | dump | diff | bench`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from passes.config import DEVICE_DEFAULTS
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF model folder (config.json + safetensors) or a .gguf file; default: the "
        "embedded SmolLM2-135M-Instruct, run from its shipped Q4_1 GGUF file",
    )
    g.add_argument(
        "--load-format", default="auto", choices=["auto", "gguf", "safetensors"],
        help="safetensors: the default model's dequantized bf16 copy instead of its GGUF file",
    )  # fmt: skip
    g.add_argument(
        "--quantization", default=None,
        help="int8 | int4 | int4_g128: quantize a float checkpoint's linear layers at load",
    )  # fmt: skip
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32 or bfloat16")
    g.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + answer in tokens"
    )
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes (CPU)")
    g.add_argument(
        "--eager", "--enforce-eager", dest="eager", action="store_true",
        help="run the plain module (no torch.compile)",
    )  # fmt: skip
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    # vLLM's engine flags, same names and defaults, so a `vllm serve` line runs unchanged.
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="requests run at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens a step")
    g.add_argument("--block-size", type=int, default=16, help="tokens a KV cache block")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="(CUDA)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    g.add_argument("--trust-remote-code", action="store_true", help="(config/tokenizer code)")
    g.add_argument(
        "--async-scheduling", action="store_true",
        help="launch each step before the last one's tokens reach the host (greedy requests)",
    )  # fmt: skip
    g.add_argument(
        "--speculative-config", type=_json_object, default=None, metavar="JSON",
        help='speculative decoding (vLLM\'s flag), e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3}\'',
    )  # fmt: skip
    g.add_argument(
        "-O", "--compilation-config", type=_json_object, default={}, metavar="JSON",
        help='compilation_config fields as JSON (vLLM\'s flag), e.g. \'{"cudagraph_mode": '
        '"PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]}\'',
    )  # fmt: skip
    _add_custom_pass_arg(g)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"want a JSON object of fields, got {text!r}")
    return value


def _add_custom_pass_arg(g) -> None:
    g.add_argument(
        "--custom-pass", action="append", default=[], metavar="MODULE:ATTR",
        help="a user pass (passes.GraphPass, PatternPass, a factory of one, or a function "
        "graph -> int) by import path, e.g. examples.silu_mul_pass:silu_mul_pass; repeatable",
    )  # fmt: skip


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--sample-seed", type=int, default=None, help="per-request seed")


def _engine_args(args: argparse.Namespace) -> dict:
    return {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory,
        "enforce_eager": args.eager,
        "seed": args.seed,
        "tokenizer": args.tokenizer,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": args.enable_prefix_caching,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "trust_remote_code": args.trust_remote_code,
        "async_scheduling": args.async_scheduling,
        "speculative_config": args.speculative_config,
        "load_format": args.load_format,
        "quantization": args.quantization,
        "compilation_config": {
            **args.compilation_config,
            "custom_passes": [*args.compilation_config.get("custom_passes", []), *args.custom_pass],
        },
    }


def _engine(args: argparse.Namespace) -> LLM:
    return LLM(args.model, **_engine_args(args))


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        stop=args.stop,
        seed=args.sample_seed,
    )


def _report(output) -> None:
    m = output.metrics
    ttft = m.time_to_first_token or 0.0
    speed = m.decode_tokens_per_s
    speed_s = f", {speed:.1f} tok/s decode" if speed else ""
    spec_s = ""
    if m.num_drafts:
        spec_s = (f", drafts accepted {m.acceptance_rate:.0%}, "
                  f"{m.mean_acceptance_length:.2f} tokens a verification")  # fmt: skip
    print(
        f"[{m.num_generated_tokens} tokens, first after {ttft * 1e3:.0f} ms{speed_s}{spec_s}]",
        file=sys.stderr,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)  # a bad sampling value is refused before the model loads
    llm = _engine(args)
    use_chat = not args.raw and getattr(llm.tokenizer, "chat_template", None)
    for prompt in args.prompt:
        if use_chat:
            out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
        else:
            out = llm.generate(prompt, params, use_tqdm=False)[0]
        print(out.outputs[0].text)
        if args.verbose:
            _report(out)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _engine(args)
    conversation = [{"role": "system", "content": args.system}] if args.system else []
    print("compilecore chat: type a message; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        conversation.append({"role": "user", "content": line})
        out = llm.chat(conversation, params, use_tqdm=False)[0]
        answer = out.outputs[0].text
        conversation.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
    return 0


# The pass switches, by the names Python takes (compilation_config["passes"]); the short
# names the CLI used to take still work.
PASS_SWITCHES = tuple(DEVICE_DEFAULTS["cpu"])
PASS_ALIASES = {"add_rms_norm": "fuse_add_rms_norm", "qkv_rope": "fuse_qkv_rope",
                "silu_and_mul": "fuse_silu_and_mul",
                "allreduce_rms_norm": "fuse_allreduce_rms_norm"}  # fmt: skip


def dump_passes(args: argparse.Namespace) -> dict[str, bool]:
    """`compilation_config["passes"]` from `--passes`, `--no-passes` and `--verify`."""
    passes: dict[str, bool] = {"verify": args.verify}
    for names, on in ((args.passes, True), (args.no_passes, False)):
        for name in names:
            passes[PASS_ALIASES.get(name, name)] = on
    return passes


def cmd_dump(args: argparse.Namespace) -> int:
    passes = dump_passes(args)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        compilation_config={
            "debug_dump_path": args.out,
            "passes": passes,
            "custom_passes": args.custom_pass,
        },
    )
    if args.prompt:
        out = llm.generate(args.prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        print(out[0].outputs[0].text, file=sys.stderr)  # its CPU graphs are in the dump
    print(f"dump written to {args.out}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from compilecore.dump_diff import diff_dumps, format_diff

    diff = diff_dumps(args.a, args.b)
    print(format_diff(diff, stat=args.stat, kernels=args.kernels))
    return 0 if diff.equal else 1


BENCHMARKS = {
    "latency": "bench_latency.py",
    "throughput": "bench_throughput.py",
    "startup": "bench_startup.py",
    "passes": "pass_ablation.py",
    "compile-options": "compile_options.py",
    "gpu": "bench_gpu.py",
    "serve": "bench_serve.py",
}


def cmd_bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    # The benchmark scripts live in the source checkout, next to the packages.
    script = Path(__file__).resolve().parent.parent / "benchmarks" / BENCHMARKS[args.which]
    if not script.is_file():
        raise ValueError(f"{script} not found: `compilecore bench` runs from a source checkout")
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from runtime.async_engine import AsyncLLM
    from runtime.entrypoints.openai_server import build_app

    # The engine thread holds the GIL through a step's Python (piece calls, Inductor's
    # wrappers); a short switch interval lets the event loop take requests in between.
    sys.setswitchinterval(args.switch_interval)
    # The engine thread builds the LLM: its kernels then own the only OpenMP team.
    if args.model_tag is not None and args.model not in (None, args.model_tag):
        raise ValueError(
            f"two models given: {args.model_tag!r} and --model {args.model!r}; give one"
        )
    args.model = args.model or args.model_tag
    template = args.chat_template  # a file, or the template itself
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    elif template is not None and "{" not in template:
        raise ValueError(f"--chat-template {template!r}: no such file, and not a template")
    engine = AsyncLLM(args.model, max_waiting=args.max_waiting, **_engine_args(args))
    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    options = json.loads(args.structured_outputs_config or "{}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    app = build_app(engine, name, api_key=args.api_key, chat_template=template,
                    disable_any_whitespace=bool(options.get("disable_any_whitespace")),
                    tool_call_parser=parser)  # fmt: skip
    print(f"compilecore: serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compilecore",
        description="A compiler-centric LLM inference engine. With no --model, it runs the "
        "embedded SmolLM2-135M-Instruct.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="answer one or more prompts and exit",
        description="Generate an answer for each prompt (greedy by default). "
        "Prompts go through the model's chat template unless --raw.",
    )
    gen.add_argument("prompt", nargs="+", help="the prompt(s)")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as-is (no chat template)")
    gen.add_argument("-v", "--verbose", action="store_true", help="print token count and speed")
    _add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=128)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat",
        help="an interactive conversation",
        description="Chat with the model; the conversation is kept across turns.",
    )
    chat.add_argument("--system", default=None, help="a system prompt")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)

    dump = sub.add_parser(
        "dump",
        help="compile a model and dump every graph as readable files",
        description="Compile the model with graph dumps on: transformed "
        "bytecode (depyf), the graph before and after the split, "
        "each piece before and after each pass, Inductor's code, "
        "and report.json/report.md.",
    )
    dump.add_argument("--out", required=True, help="the dump folder")
    dump.add_argument("--prompt", default=None, help="also generate a few tokens for this prompt")
    for flag, what in (
        ("--passes", f"passes to turn on, by their Python names ({', '.join(PASS_SWITCHES)})"),
        ("--no-passes", "passes to turn off (e.g. gemv_to_reduction); the rest keep the default"),
    ):
        choices = [*PASS_SWITCHES, *PASS_ALIASES]
        dump.add_argument(flag, nargs="*", default=[], choices=choices, metavar="PASS", help=what)
    dump.add_argument(
        "--verify", action="store_true", help="verify every pass on every piece (names a bad one)"
    )
    _add_custom_pass_arg(dump)
    dump.add_argument("--model", default=None, help="HF model folder (default: SmolLM2)")
    dump.add_argument("--dtype", default="auto")
    dump.add_argument("--max-model-len", type=int, default=None)
    dump.add_argument("--kv-cache-memory", type=int, default=None)
    dump.set_defaults(func=cmd_dump)

    diff = sub.add_parser(
        "diff",
        help="compare two dumps (exit 0 when equal, 1 when not)",
        description="Pair the files of two dumps, normalize addresses, "
        "generated names, hashes and paths, and print what each pass rewrote "
        "(its own before/after graphs, identical pieces grouped), the op-count "
        "deltas, then a unified diff of each other changed file.",
    )
    diff.add_argument("a")
    diff.add_argument("b")
    diff.add_argument("--stat", action="store_true", help="the summary only")
    diff.add_argument("--kernels", action="store_true", help="also diff Inductor's output code")
    diff.set_defaults(func=cmd_diff)

    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions (with streaming), "
        "/v1/models, /health, /metrics, /tokenize and /detokenize.",
    )
    serve.add_argument(
        "model_tag", nargs="?", default=None, help="HF model folder, as in `vllm serve MODEL`"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use")
    serve.add_argument("--max-waiting", type=int, default=256, help="queued requests (then 503)")
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": calls parsed from the text (vLLM\'s flag)',
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes"],
        help="how auto tool calls are written: hermes (<tool_call>{...})",
    )
    serve.add_argument("--structured-outputs-config", default=None,
                       help='JSON, vLLM\'s: {"disable_any_whitespace": true}')  # fmt: skip
    serve.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="warning")
    serve.add_argument(
        "--chat-template", default=None,
        help="the default chat template: a file, or the template itself (vLLM's flag)",
    )  # fmt: skip
    for flag in ("--disable-log-requests", "--disable-log-stats"):  # vLLM's; we log neither
        serve.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    serve.add_argument(
        "--switch-interval",
        type=float,
        default=0.0005,
        help="Python's thread switch interval in seconds (engine vs HTTP)",
    )
    _add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser(
        "bench",
        help="run a benchmark (benchmarks/*.py) side by side with peers",
        description="Run one of the benchmark scripts; arguments after the "
        "name go to the script (e.g. `compilecore bench latency "
        "--tokens 128`). Results land in benchmarks/results/.",
    )
    bench.add_argument("which", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        print(f"compilecore: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
