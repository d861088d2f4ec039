"""Check the CPU kernel models (lightning_memest/accounting/kernels/) against op calls recorded by
find_kernel_workspaces.py --json.

Usage: python benchmarks/check_kernel_models.py runs/*.json -- prints, per op and precision, the exact calls
and the absolute error in bytes against the measured excess and under-reported outputs."""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from lightning_memest.accounting.kernels import CPU_KERNELS, OpCall, TensorMeta, kernel_memory

DT = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.float64,
    )
}


def meta(x):
    if isinstance(x, dict) and "shape" in x:
        return TensorMeta(tuple(x["shape"]), tuple(x["stride"]), DT[x["dtype"]], "cpu", x["nbytes"])
    if isinstance(x, list):
        return [meta(v) for v in x]
    return x


def opof(name):
    ns, op, ov = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), ov)


def main(files: list[str]) -> None:
    stats = defaultdict(lambda: [0, 0, 0, 0, []])  # n, exact, abs err sum, measured sum
    for f in sorted(files):
        if "lstm_pts" in f:
            continue
        d = json.loads(Path(f).read_text())
        m = d["meta"]
        for c in d["calls"]:
            if not c["op"].startswith("aten."):
                continue
            op = opof(c["op"])
            if CPU_KERNELS.lookup(op) is None:
                if c["excess"] > 65536:
                    stats["(unmodelled) " + c["op"]][4].append((m["model"], m["precision"], c["excess"]))
                continue
            args = tuple(meta(a) for a in c["args"])
            outs = tuple(meta(o) for o in c["outputs"])
            if c["op"] == "aten.mkldnn_rnn_layer.default":  # the fake run's workspace output has 0 bytes
                o = outs[3]
                outs = (*outs[:3], TensorMeta(o.shape, o.stride, o.dtype, "cpu", 0))
            km = kernel_memory(OpCall(op, args, {k: meta(v) for k, v in c["kwargs"].items()}, outs, "cpu"))
            pred = km.workspace_bytes if km else 0
            extra = sum(km.extra_output_bytes) if km and km.extra_output_bytes else 0
            meas = c["excess"]
            meas_extra = (c["out_real"] - c["out_fake"]) if c["out_fake"] is not None else 0
            key = (c["op"], m["precision"].split("-")[0])
            st = stats[key]
            st[0] += 1
            st[1] += pred == meas and extra == meas_extra
            st[2] += abs(pred - meas) + abs(extra - meas_extra)
            st[3] += meas + meas_extra
            if pred != meas or extra != meas_extra:
                st[4].append((m["model"], meas, pred, meas_extra, extra))
    for k, (n, ex, err, tot, bad) in sorted(stats.items(), key=lambda kv: str(kv[0])):
        print(k, f"calls {n} exact {ex} abs_err {err:,} measured {tot:,}")
        for b in bad[:3]:
            print("     ", b)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="JSON files written by find_kernel_workspaces.py --json")
    main(parser.parse_args().files)
