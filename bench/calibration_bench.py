"""Self-calibration of predicted TTFT against the simulator's true prefill cost, with a mid-run slowdown.

Real Envoy -> `epp serve` with a self-calibrating `predicted-ttft-scorer` (a sample config of
examples/configs/, given nothing about the simulator) -> simulated vLLM replicas. Phase 1 sends
`--requests` streamed completions of unique prompts (256-4,096 tokens, Poisson arrivals) and
reads the picker's learned `prefill_seconds_per_token` per replica from its /metrics; then every
replica is slowed down `--slowdown` times (`POST /sim/speed`) and phase 2 sends as many again.
The true cost (known here, never to the picker) is the profile's prefill per token x time scale
x slowdown. Reports the learned value and its error per replica after each phase.

    python bench/calibration_bench.py --requests 200 --rate 6 --slowdown 2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.routing.contenders import Tuning, start_contender  # noqa: E402
from bench.routing.experiments import known  # noqa: E402
from bench.routing.workloads import completion_request, text_of_tokens, tokenizer  # noqa: E402
from epp.calibration_cli import read_calibration  # noqa: E402
from epp.engine.sim import FleetConfig, SimFleet  # noqa: E402
from epp.engine.sim.fleet import default_tokenizer_dir  # noqa: E402
from epp.engine.sim.profiles import get_profile  # noqa: E402

PROFILE = "h100-llama3-8b"


async def send(http: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with http.post(url, json=body) as resp:
        await resp.read()


async def phase(http: aiohttp.ClientSession, url: str, prompts: list[str], rate: float, seed: int) -> None:
    """Open-loop Poisson arrivals; waits for every request to finish."""
    rng = random.Random(seed)
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(send(http, url, completion_request(prompt, 8, "cal").body)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


async def learned(http: aiohttp.ClientSession, metrics_url: str) -> dict[str, float]:
    async with http.get(metrics_url) as resp:
        rows = read_calibration(await resp.text())
    return {endpoint: values["prefill_seconds_per_token"] for (_, endpoint, _), values in rows.items()
            if "prefill_seconds_per_token" in values}


def table(title: str, values: dict[str, float], truth: float) -> str:
    lines = [f"{title}: true prefill {truth * 1e6:.1f} us/token (wall clock)",
             "| replica | learned (us/token) | error |", "|---|---|---|"]
    for endpoint, value in sorted(values.items()):
        lines.append(f"| {endpoint} | {value * 1e6:.1f} | {100 * (value / truth - 1):+.1f}% |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> int:
    tok_dir = default_tokenizer_dir()
    tok = tokenizer(tok_dir)
    rng = random.Random(args.seed)
    prompts = [text_of_tokens(rng, rng.randint(256, 4096), tok, f"cal{i}:") for i in range(2 * args.requests)]
    contender = known()[args.contender]
    truth = get_profile(PROFILE).prefill_per_token * args.time_scale
    config = FleetConfig(replicas=args.replicas, model="sim-model", tokenizer_dir=tok_dir, profile=PROFILE,
                         time_scale=args.time_scale, num_gpu_blocks=4000, processes=1)
    async with SimFleet(config) as fleet, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        tuning = Tuning(tok_dir, 16, 0.0, 0)  # nothing about the simulator's costs
        with tempfile.TemporaryDirectory() as workdir:
            router = await start_contender(contender, fleet, tuning, Path(workdir))
            try:
                url = router.base_url + "/v1/completions"
                started = time.monotonic()
                await phase(http, url, prompts[:args.requests], args.rate, args.seed)
                before = await learned(http, router.metrics_url)
                for endpoint in fleet.endpoints:
                    async with http.post(f"http://{endpoint}/sim/speed?slowdown={args.slowdown}") as resp:
                        assert resp.status == 200, await resp.text()
                await phase(http, url, prompts[args.requests:], args.rate / args.slowdown, args.seed + 1)
                after = await learned(http, router.metrics_url)
                elapsed = time.monotonic() - started
            finally:
                await router.stop()
    print(f"contender {contender.name}: {contender.description}")
    print(f"{args.replicas} replicas ({PROFILE}, time scale {args.time_scale:g}), {args.requests} requests per phase, "
          f"{args.rate:g} req/s then {args.rate / args.slowdown:g} req/s, {elapsed:.0f} s\n")
    print(table(f"after {args.requests} requests", before, truth))
    print()
    print(table(f"after {args.requests} more at {args.slowdown:g}x slower", after, truth * args.slowdown))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="requests per phase (default 200)")
    parser.add_argument("--rate", type=float, default=6.0, help="requests/s in phase 1 (default 6)")
    parser.add_argument("--slowdown", type=float, default=2.0, help="replica slowdown for phase 2 (default 2)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=5.0, help="simulator slowdown (default 5)")
    parser.add_argument("--contender", default="epp-approx-ttft", choices=[n for n, c in known().items()
                                                                          if c.kind == "epp"])
    parser.add_argument("--seed", type=int, default=7)
    sys.exit(asyncio.run(main(parser.parse_args())))
