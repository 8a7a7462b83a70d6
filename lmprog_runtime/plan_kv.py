"""`lmprog-runtime plan-kv`: what handing a request's KV from a prefill server to a decode
server costs, and whether prefill/decode disaggregation pays off for a workload.

The cost of moving KV is bytes over bandwidth (docs/plan-kv.md):

    bytes/token   = 2 (K and V) x layers x kv_heads x head_dim x bytes(KV dtype)
    bytes/request = pages(prompt) x page_size x bytes/token        (the prompt's KV crosses;
                    the output's KV is made on the decode side)
    transfer      = writes x latency + bytes/request / bandwidth  (writes = 2 x layers: one
                    K and one V write per layer, as a page-contiguous pool is sent)

The decision compares one colocated server with the same compute split in two halves, a
prefill side and a decode side (Tp: prefill time of the prompt, Td: one decode step, both
measured on the whole machine; s_p, s_d: how much slower each is on half of it; rho = λ·Tp,
the share of time a colocated server spends prefilling at arrival rate λ):

    colocated     mean ITL = Td / (1 - rho)        a running stream also waits out whole
                  worst stall = Td + Tp            prefills (unstable when rho >= 1)
    disaggregated mean ITL = s_d·Td               no prefill ever runs on the decode side
                  TTFT = s_p·Tp + transfer         (prefill side unstable when λ·s_p·Tp >= 1)

It pays off when the prefill side keeps up (λ·s_p·Tp < 1), the decode side's ITL is lower
(s_d·Td < Td / (1 - rho)), and moving the KV is cheaper than the prefill it follows
(transfer < s_p·Tp). This module is torch-free; measuring lives in plan_kv_measure.py.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from typing import Dict, Tuple

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}

# name -> (effective bandwidth in bytes/s, latency per write in s, what it stands for).
# Effective = line rate x a typical efficiency; `--measure-link` measures the first one here.
GB = 1e9
TOPOLOGIES: Dict[str, Tuple[float, float, str]] = {
    "tcp-same-host": (2.0 * GB, 50e-6, "Mooncake TCP over loopback (kernel copies both ways)"),
    "shm-same-host": (8.0 * GB, 2e-6, "shared memory: one memcpy at single-thread DRAM speed"),
    "rdma-100g": (11.0 * GB, 5e-6, "100 Gb/s RDMA NIC, ~90% of line rate"),
    "rdma-200g": (22.0 * GB, 5e-6, "200 Gb/s RDMA NIC, ~90% of line rate"),
    "rdma-400g": (44.0 * GB, 5e-6, "400 Gb/s RDMA NIC, ~90% of line rate"),
    "pcie4-x16": (25.0 * GB, 2e-6, "PCIe 4.0 x16 peer copy (32 GB/s raw)"),
    "pcie5-x16": (50.0 * GB, 2e-6, "PCIe 5.0 x16 peer copy (64 GB/s raw)"),
}

_RATE_UNITS = {"b/s": 1 / 8, "kb/s": 1e3 / 8, "mb/s": 1e6 / 8, "gb/s": 1e9 / 8, "tb/s": 1e12 / 8,
               "B/s": 1, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
               "KiB/s": 1024, "MiB/s": 1024 ** 2, "GiB/s": 1024 ** 3}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_rate(text: str) -> float:
    """'25GB/s' -> 25e9 bytes/s; '100Gb/s' (lower-case b: bits) -> 12.5e9."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([KMGT]?i?[Bb]/s)\s*", text)
    unit = m and (m.group(2) if m.group(2) in _RATE_UNITS else m.group(2).lower())
    if not m or unit not in _RATE_UNITS:
        raise ValueError(f"--link: expected a rate like 25GB/s, 100Gb/s or 800MiB/s, got {text!r}")
    return float(m.group(1)) * _RATE_UNITS[unit]


def parse_duration(text: str) -> float:
    """'10us' -> 1e-5 s."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*(ns|us|µs|ms|s)\s*", text)
    if not m:
        raise ValueError(f"--latency: expected a duration like 10us, 0.5ms or 2ns, got {text!r}")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


# -- bytes --------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int = 1

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def transfer_bytes(self, prompt_tokens: int) -> int:
        """Bytes that cross for one request: the prompt's KV, in whole pages."""
        return self.pages(prompt_tokens) * self.page_size * self.bytes_per_token

    @property
    def writes_per_request(self) -> int:
        return 2 * self.num_layers


def transfer_seconds(shape: KVShape, prompt_tokens: int, bandwidth: float, latency: float) -> float:
    return shape.writes_per_request * latency + shape.transfer_bytes(prompt_tokens) / bandwidth


# -- the decision -------------------------------------------------------------------------
@dataclass(frozen=True)
class Rates:
    """Measured (or given) on the whole machine; slowdowns: on half of it."""

    prefill_s: float  # Tp: the prompt's prefill (to the first token)
    decode_step_s: float  # Td: one decode step
    prefill_slowdown: float = 2.0  # s_p
    decode_slowdown: float = 2.0  # s_d
    source: str = "given"


@dataclass(frozen=True)
class Verdict:
    rho: float
    colocated_itl_s: float  # inf when the colocated server cannot keep up
    colocated_worst_stall_s: float
    disagg_itl_s: float
    disagg_ttft_s: float
    colocated_ttft_s: float
    prefill_side_load: float  # λ·s_p·Tp; < 1 to keep up
    transfer_s: float
    pays_off: bool
    reason: str


def decide(rates: Rates, arrival_rate: float, transfer_s: float) -> Verdict:
    tp, td, sp, sd = rates.prefill_s, rates.decode_step_s, rates.prefill_slowdown, rates.decode_slowdown
    rho = arrival_rate * tp
    colo_itl = td / (1 - rho) if rho < 1 else math.inf
    side_load = arrival_rate * sp * tp
    disagg_itl = sd * td
    if side_load >= 1:
        pays, why = False, f"the prefill side cannot keep up (λ·s_p·Tp = {side_load:.2f} >= 1)"
    elif transfer_s >= sp * tp:
        pays, why = False, f"moving the KV ({_ms(transfer_s)}) costs more than the prefill ({_ms(sp * tp)})"
    elif disagg_itl >= colo_itl:
        pays, why = False, (f"decode on half the machine ({_ms(disagg_itl)}/token) is slower than colocated "
                            f"decode with prefills in between ({_ms(colo_itl)}/token, rho = {rho:.2f})")
    else:
        pays, why = True, (f"prefills take {rho:.0%} of a colocated server: its ITL {_ms(colo_itl)} vs "
                           f"{_ms(disagg_itl)} on a decode-only half; the transfer adds {_ms(transfer_s)} to TTFT")
    return Verdict(rho, colo_itl, td + tp, disagg_itl, sp * tp + transfer_s, tp, side_load, transfer_s, pays, why)


def _ms(seconds: float) -> str:
    if math.isinf(seconds):
        return "inf"
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.3g} ms"


# -- the command ----------------------------------------------------------------------------
def add_plan_kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default="default", help="model whose config sizes the KV (default: the "
                   "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="prompt length of a request, in tokens")
    p.add_argument("--output-tokens", type=int, default=128, help="output length of a request, in tokens")
    p.add_argument("--arrival-rate", type=float, default=0.5, help="long requests per second arriving")
    p.add_argument("--page-size", type=int, default=1, help="KV pool page size in tokens (whole pages move)")
    p.add_argument("--dtype", default="auto", help="KV dtype: auto (the runner's choice when calibrating, else "
                   f"the checkpoint's), or one of {', '.join(DTYPE_BYTES)}")
    p.add_argument("--link", default=None, help="a custom link's bandwidth, e.g. 25GB/s or 100Gb/s")
    p.add_argument("--latency", default="10us", help="the custom link's latency per write, e.g. 10us")
    p.add_argument("--no-calibrate", action="store_true", help="do not run the model; use --prefill-tokens-per-s "
                   "and --decode-step-ms")
    p.add_argument("--prefill-tokens-per-s", type=float, default=None, help="prefill rate (with --no-calibrate)")
    p.add_argument("--decode-step-ms", type=float, default=None, help="one decode step (with --no-calibrate)")
    p.add_argument("--prefill-slowdown", type=float, default=None, help="s_p: prefill on half the machine vs "
                   "all of it (default: measured with half the threads when calibrating, else 2)")
    p.add_argument("--decode-slowdown", type=float, default=None, help="s_d: the same for one decode step")
    p.add_argument("--calibrate-tokens", type=int, default=512, help="prompt length the calibration runs; "
                   "the prefill time is scaled linearly to --prompt-tokens (set it equal for an exact run)")
    p.add_argument("--num-threads", type=int, default=None, help="threads of the calibration run (unset: all cores)")
    p.add_argument("--measure-link", action="store_true", help="measure a Mooncake TCP transfer between two "
                   "processes here and compare it with the tcp-same-host prediction")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def model_shape(args) -> Tuple[KVShape, str]:
    """(the KV shape from the model's real config, the checkpoint's dtype name)."""
    from lmprog_runtime.model_executor.loader import load_model_config
    from lmprog_runtime.model_paths import resolve_model_path

    c = load_model_config(resolve_model_path(args.model_path))
    dtype = c.torch_dtype if args.dtype == "auto" else args.dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"--dtype: expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return KVShape(c.num_layers, c.num_kv_heads, c.head_dim, dtype, args.page_size), c.torch_dtype


def get_rates(args, shape: KVShape) -> Tuple[Rates, KVShape]:
    if args.no_calibrate:
        if not args.prefill_tokens_per_s or not args.decode_step_ms:
            raise ValueError("--no-calibrate needs --prefill-tokens-per-s and --decode-step-ms")
        rates = Rates(args.prompt_tokens / args.prefill_tokens_per_s, args.decode_step_ms / 1000,
                      args.prefill_slowdown or 2.0, args.decode_slowdown or 2.0, "given")
        return rates, shape
    from lmprog_runtime.plan_kv_measure import calibrate

    return calibrate(args, shape)


def build_plan(args) -> dict:
    if min(args.prompt_tokens, args.output_tokens, args.page_size, args.calibrate_tokens) < 1 or args.arrival_rate < 0:
        raise ValueError("--prompt-tokens, --output-tokens, --page-size and --calibrate-tokens must be >= 1, "
                         "--arrival-rate >= 0")
    shape, _ = model_shape(args)
    rates, shape = get_rates(args, shape)
    links = dict(TOPOLOGIES)
    if args.link:
        links["custom"] = (parse_rate(args.link), parse_duration(args.latency), f"--link {args.link} "
                                                                                f"--latency {args.latency}")
    measured = None
    if args.measure_link:
        from lmprog_runtime.plan_kv_measure import measure_mooncake_tcp

        measured = measure_mooncake_tcp(shape.transfer_bytes(args.prompt_tokens))
        predicted = transfer_seconds(shape, args.prompt_tokens, *TOPOLOGIES["tcp-same-host"][:2])
        measured["predicted_s"] = predicted
        measured["factor_measured_over_predicted"] = measured["transfer_s"] / predicted
    rows = []
    for name, (bw, lat, what) in links.items():
        t = transfer_seconds(shape, args.prompt_tokens, bw, lat)
        rows.append({"topology": name, "bandwidth_GBps": bw / GB, "latency_us": lat * 1e6, "what": what,
                     "transfer_s": t, "verdict": asdict(decide(rates, args.arrival_rate, t))})
    return {"model_path": args.model_path, "kv": {**asdict(shape), "bytes_per_token": shape.bytes_per_token},
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "arrival_rate": args.arrival_rate,
            "bytes_per_request_transferred": shape.transfer_bytes(args.prompt_tokens),
            "bytes_per_request_total": shape.transfer_bytes(args.prompt_tokens + args.output_tokens),
            "rates": asdict(rates), "links": rows, "measured_link": measured}


def render(plan: dict) -> str:
    kv, r = plan["kv"], plan["rates"]
    out = [f"Model {plan['model_path']}: {kv['num_layers']} layers x {kv['num_kv_heads']} KV heads x "
           f"{kv['head_dim']} head dim, KV {kv['dtype']}, page {kv['page_size']} token(s)",
           f"  KV per token: {kv['bytes_per_token']:,} bytes (2 x layers x kv_heads x head_dim x dtype bytes)",
           f"  per request ({plan['prompt_tokens']} prompt + {plan['output_tokens']} output tokens): "
           f"{plan['bytes_per_request_transferred'] / 2**20:.2f} MiB crosses (the prompt's pages), "
           f"{plan['bytes_per_request_total'] / 2**20:.2f} MiB at the end",
           f"  prefill {r['prefill_s'] * 1000:.1f} ms, decode step {r['decode_step_s'] * 1000:.2f} ms "
           f"(whole machine, {r['source']}); on half of it x{r['prefill_slowdown']:.2f} / "
           f"x{r['decode_slowdown']:.2f}",
           f"  workload: {plan['arrival_rate']} long requests/s -> a colocated server prefills "
           f"{plan['links'][0]['verdict']['rho']:.0%} of the time", "",
           f"  {'topology':15s} {'GB/s':>6s} {'lat':>6s} {'transfer':>10s} {'disagg TTFT':>12s} "
           f"{'ITL colo':>9s} {'ITL disagg':>10s}  pays off?"]
    for row in plan["links"]:
        v = row["verdict"]
        out.append(f"  {row['topology']:15s} {row['bandwidth_GBps']:6.1f} {row['latency_us']:5.0f}u "
                   f"{_ms(row['transfer_s']):>10s} {_ms(v['disagg_ttft_s']):>12s} {_ms(v['colocated_itl_s']):>9s} "
                   f"{_ms(v['disagg_itl_s']):>10s}  {'yes' if v['pays_off'] else 'no'}")
    reasons = dict.fromkeys(row["verdict"]["reason"] for row in plan["links"])
    out += ["", "  why: " + "\n       ".join(reasons)]
    out.append(f"  colocated worst stall of a stream: {_ms(plan['links'][0]['verdict']['colocated_worst_stall_s'])}"
               " (a token waits for a whole prefill)")
    m = plan.get("measured_link")
    if m:
        out.append(f"  measured Mooncake TCP here: {m['bytes'] / 2**20:.2f} MiB in {_ms(m['transfer_s'])} "
                   f"({m['bandwidth_GBps']:.2f} GB/s, {m['latency_us']:.0f} us per small write); predicted "
                   f"{_ms(m['predicted_s'])}: measured / predicted = {m['factor_measured_over_predicted']:.2f}")
    return "\n".join(out)


def main(ns: argparse.Namespace) -> int:
    try:
        plan = build_plan(ns)
    except (ValueError, RuntimeError) as e:
        print(f"lmprog-runtime plan-kv: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=1) if ns.json else render(plan))
    return 0

