"""``afl bench extract``: images/s of the full extraction pipeline vs the backbone's forward pass.

The pipeline figure covers decode (Pillow) + preprocess + DataLoader workers + host→device copy +
forward + cache writes (``afl.client.features.extract.extract_features``); the forward figure runs the same
backbone on a pre-built batch already on the device. The ratio pipeline / forward is the figure of
merit (1.0 = the input pipeline costs nothing; the target is ≥ 0.9 on GPU). Images are generated
PNGs (uint8, ``image_size`` px) and the backbone is random-init: throughput does not depend on
weight values.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from afl.client.features.backbones import load_backbone
from afl.client.features.extract import extract_features, resolve_device
from afl.client.features.sitedata import manifest_source


def _make_pngs(root: Path, n: int, size: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = ["path,A"]
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size), dtype=np.uint8)).save(root / f"{i}.png")
        lines.append(f"{i}.png,{i % 2}")
    (root / "manifest.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root / "manifest.csv"


def _sync(dev: Any) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _forward_rate(bb: Any, dev: Any, *, batch_size: int, batches: int, bf16: bool) -> float:
    size = bb.preprocess.crop_size
    x = torch.randn(batch_size, bb.preprocess.channels, size, size, device=dev)
    module = bb.module.to(dev)
    with torch.inference_mode(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        module(x)  # warm-up (kernel selection, allocator)
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(batches):
            module(x).float().cpu()  # the pipeline also copies features back
        _sync(dev)
        return batches * batch_size / (time.perf_counter() - t0)


def run_extract_bench(
    *,
    backbone: str,
    device: str = "auto",
    batch_size: int = 32,
    num_images: int = 256,
    workers: int = 4,
    image_size: int = 1024,
    bf16: bool = False,
    channels_last: bool = False,
) -> dict[str, Any]:
    """Measure pipeline and pure-forward images/s on the same device and batch size."""
    dev = resolve_device(device)
    bb = load_backbone(backbone, random_init=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = manifest_source(_make_pngs(root / "images", num_images, image_size))
        # warm-up run on one batch so that both figures exclude one-off start-up costs
        warm = manifest_source(_make_pngs(root / "warm", batch_size, image_size))
        extract_features(warm, bb, root / "warm-cache", batch_size=batch_size, device=device,
                         progress=False)  # fmt: skip
        t0 = time.perf_counter()
        extract_features(
            source, bb, root / "cache", batch_size=batch_size, workers=workers, device=device,
            bf16=bf16, channels_last=channels_last, progress=False,
        )  # fmt: skip
        pipeline = num_images / (time.perf_counter() - t0)
    batches = max(1, num_images // batch_size)
    forward = _forward_rate(bb, dev, batch_size=batch_size, batches=batches, bf16=bf16)
    return {
        "bench": "extract",
        "backbone": backbone,
        "random_init": True,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "batch_size": batch_size,
        "num_images": num_images,
        "image_size": image_size,
        "workers": workers,
        "bf16": bf16,
        "channels_last": channels_last,
        "pipeline_images_per_s": pipeline,
        "forward_images_per_s": forward,
        "ratio": pipeline / forward,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backbone", default="xrv-densenet121-all")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-images", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=1024, help="generated PNG side (px)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--json", dest="json_out", help="write the result here (default stdout)")


def run(args: argparse.Namespace) -> int:
    result = run_extract_bench(
        backbone=args.backbone,
        device=args.device,
        batch_size=args.batch_size,
        num_images=args.num_images,
        workers=args.workers,
        image_size=args.image_size,
        bf16=args.bf16,
        channels_last=args.channels_last,
    )
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(cli)
    raise SystemExit(run(cli.parse_args()))
