"""One real vLLM process, as a test or a benchmark asks for it.

    python engine.py SPEC.json OUT.json

SPEC names the model directory, vLLM's block size and KV cache bytes,
the Lake connector's ``kv_connector_extra_config`` (or null: vLLM alone)
and phases run one after another in this process (vLLM's own prefix
cache lives across them). Each phase generates greedily from token-id
prompts; OUT gets every request's tokens and top-k logprobs, the phase's
wall time and vLLM's own counters after it. A phase may say
``"kill_after_tokens": N``: the process then SIGKILLs itself once the
first request has produced N tokens (what a crashed engine leaves
behind); ``"abort_after_steps": N``: the first request is aborted after N
engine steps (a client gone), the others run to their end. With
``"metrics_port": P`` the process serves vLLM's Prometheus registry —
what its OpenAI server exposes at /metrics — on P of
``"metrics_host"`` (127.0.0.1 unless given) while it runs. Run with VLLM_CPU_NUM_OF_RESERVED_CPU=1 (the tests set it)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time


def environment(multiprocess: bool = False) -> dict:
    """The environment an engine process runs in: one compute thread and
    one reserved core whether or not a connector is configured and whether
    vLLM runs its worker in this process or another (thread counts change
    float results), and the `lake` package beside this directory."""
    env = dict(os.environ)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
    return env


def counters(llm) -> dict:
    """vLLM's own counters (its Prometheus metrics) by name."""
    out: dict = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            out[metric.name] = out.get(metric.name, 0) + value
        elif hasattr(metric, "sum") and hasattr(metric, "count"):
            # A histogram: its sum and count (counters read back as ints).
            out[metric.name + "_sum"] = out.get(metric.name + "_sum", 0) + metric.sum
            out[metric.name + "_count"] = out.get(metric.name + "_count", 0) + metric.count
    return out


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    spec = json.loads(open(spec_path).read())
    # The connector's own lines (its namespace, its pulls) in the log, as
    # an operator's engine would show them.
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lake").setLevel(logging.INFO)
    transfer = None
    if spec.get("connector") is not None:
        transfer = KVTransferConfig(
            kv_connector="LakeConnector",
            kv_connector_module_path="lake.vllm",
            # A P/D deployment's roles (kv_producer, kv_consumer), or both.
            kv_role=spec.get("kv_role", "kv_both"),
            kv_connector_extra_config=spec["connector"],
            # What vLLM does with a load the connector reports failed:
            # "fail" the request (vLLM's default) or "recompute" it.
            kv_load_failure_policy=spec.get("load_failure_policy", "fail"),
        )
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=spec.get("dtype", "bfloat16"),
        block_size=spec["block_size"],
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec.get("max_num_seqs", 8),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", spec["max_model_len"]),
        enable_prefix_caching=spec.get("prefix_caching", True),
        kv_transfer_config=transfer,
        speculative_config=spec.get("speculative"),
        disable_log_stats=False,
        seed=0,
    )
    if spec.get("metrics_port"):
        from prometheus_client import start_http_server

        start_http_server(spec["metrics_port"], addr=spec.get("metrics_host") or "127.0.0.1")
    results = {"phases": []}
    for phase in spec["phases"]:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=phase["max_tokens"],
            logprobs=phase.get("logprobs", 5),
            ignore_eos=True,
            detokenize=False,
        )
        prompts = [{"prompt_token_ids": prompt_of(p, spec["phases"], results)} for p in phase["prompts"]]
        # Saves are asynchronous: a phase that is to find the last one's
        # blocks in the pool may wait for them to land.
        time.sleep(phase.get("sleep_before", 0))
        # A phase may first wait for the test to do something to the pool
        # (stop it): this process says it is there, then waits for the go.
        if "wait_for" in phase:
            open(phase["wait_for"] + ".ready", "w").close()
            while not os.path.exists(phase["wait_for"]):
                time.sleep(0.05)
        kill_after = phase.get("kill_after_tokens")
        started = time.perf_counter()
        if kill_after is not None:
            run_until_killed(llm, prompts, params, kill_after, out_path)
        elif "abort_after_steps" in phase:
            outputs = run_aborting_first(llm, prompts, params, phase["abort_after_steps"])
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        requests = []
        for output in outputs:
            if output is None:
                requests.append(None)
                continue
            completion = output.outputs[0]
            requests.append(
                {
                    "tokens": list(completion.token_ids),
                    "logprobs": [
                        sorted([int(t), float(lp.logprob)] for t, lp in step.items()) for step in completion.logprobs
                    ],
                }
            )
        results["phases"].append(
            {
                "prompts": [p["prompt_token_ids"] for p in prompts],
                "requests": requests,
                "seconds": elapsed,
                "counters": counters(llm),
            }
        )
    with open(out_path + ".partial", "w") as f:
        json.dump(results, f)
    os.replace(out_path + ".partial", out_path)


def prompt_of(prompt, phases, results) -> list[int]:
    """A prompt's token ids: a list, or ``{"after": i, "then": [...]}`` —
    the first prompt of phase i, what it generated, then more tokens (a
    conversation's next turn)."""
    if isinstance(prompt, list):
        return prompt
    earlier = phases[prompt["after"]]["prompts"][0]
    generated = results["phases"][prompt["after"]]["requests"][0]["tokens"]
    return prompt_of(earlier, phases, results) + generated + list(prompt["then"])


def run_aborting_first(llm, prompts, params, steps: int):
    """Steps the engine by hand and aborts the first request after
    ``steps`` steps (as a client that went away); the others run to their
    end. The aborted one's output is None."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finished: dict[str, object] = {}
    taken = 0
    while engine.has_unfinished_requests():
        if taken == steps:
            engine.abort_request(["0"])
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        taken += 1
    return [None] + [finished[str(i)] for i in range(1, len(prompts))]


def run_until_killed(llm, prompts, params, tokens: int, out_path: str):
    """Steps the engine by hand and dies by SIGKILL once the first request
    has ``tokens`` output tokens: no shutdown, no request_finished. What it
    had generated is written to OUT first (what a client had streamed),
    with vLLM's counters then."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            generated = list(output.outputs[0].token_ids)
            if len(generated) >= tokens:
                with open(out_path, "w") as f:
                    json.dump({"phases": [], "streamed": generated, "counters": counters(llm)}, f)
                # The saves handed to the data plane at earlier steps land
                # meanwhile, as they would for a process killed later.
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("the requests finished before the kill point")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
