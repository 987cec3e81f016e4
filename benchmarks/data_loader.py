"""The data path: yarnapp's streaming loader against torch's DataLoader, data wait in a
real training job, and the shuffle's read amplification and memory per rank.

    python benchmarks/data_loader.py [--quick] [--repeat 3] [--parts loader,wait,shuffle] [--workers 2]

loader   images/s of one epoch (after a warm-up epoch; both timed from the epoch's 3rd
         batch on, past torch's refill at iter() and ours' read-ahead across the epoch's
         edge) over the same Parquet files of JPEG images, decoded, augmented and
         normalised into float32 batches:
           32x32    synthetic CIFAR as JPEG (`data import synthetic-cifar --encoding jpeg`),
                    random crop (padding 4) + horizontal flip, batch 256
           224x224  smooth random photos as JPEG, random resized crop to 224 + flip, batch 64
         ours: ParquetSource.batches with `--workers` decoding threads (streamed from the
         files, shuffled). torch: a DataLoader with as many worker processes,
         persistent_workers, shuffle=True, the same batch size, over a Dataset that holds
         the files' encoded images in memory (read once per worker: its best case, no
         I/O while timed) and decodes with the same decoder (simplejpeg), applying the
         same ops per image with numpy/Pillow. Ratio ours / torch, the median of each
         round's ratios; each goes first in every other round.
wait     a real `yarnapp submit`: ResNet-20 on CIFAR-shaped JPEG data (random crop +
         flip), 2 containers of 1 vcore each, global batch 128, `--steps` steps; the
         runner's data_wait_pct (time blocked on data / step time, rank 0).
shuffle  a real `yarnapp submit` over one epoch of 3x32x32 raw images (synthetic CIFAR,
         `--rows` rows, 2 MiB row groups) on 1 x 1 vcore + 2 x 0.5 vcore containers,
         shares by vcores, the default shuffle (64 MiB windows): bytes read by all ranks /
         dataset size (read amplification), and each container's memory peaks from its
         cgroup. Also the amplification the order predicts (every block a rank touches
         read once), and the same for rank slices drawn at random from each batch (what
         a loader without position-ordered slices reads: every rank every block).

Medians of `--repeat` interleaved rounds; writes benchmarks/results/data_loader.json.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one round, smaller data")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--parts", default="loader,wait,shuffle")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--steps", type=int, default=80, help="wait: training steps per run")
    p.add_argument("--rows", type=int, default=60000, help="shuffle: rows of the raw dataset")
    common.add_out(p, "data_loader")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data

def photos(n, size=224, seed=0):
    """n smooth random RGB images as JPEG (quality 90): 7x7 colour fields upsampled, plus noise."""
    import numpy as np
    import simplejpeg
    from PIL import Image
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        coarse = Image.fromarray(rng.integers(0, 256, (7, 7, 3), dtype=np.uint8))
        img = np.asarray(coarse.resize((size, size), Image.BICUBIC), dtype=np.float32)
        img = np.clip(img + rng.normal(0, 8, img.shape), 0, 255).astype(np.uint8)
        out.append(simplejpeg.encode_jpeg(img, quality=90))
    return out


def write_photos(uri, n):
    import numpy as np
    from training.data import meta, write_encoded
    write_encoded(uri, photos(n), np.arange(n) % 10, meta(None, 10, range(10), None, None, "photos",
                                                           encoding="encoded"))


# ----------------------------------------------------------------------------- loader

class ParquetJPEG:
    """torch's side: a map-style Dataset over the same Parquet files, encoded images held
    in memory per worker, decoded with simplejpeg, the same ops as ours per image."""

    def __init__(self, uri, size, crop, mean, std):
        self.uri, self.size, self.crop = uri, size, crop
        self.mean, self.std = mean, std
        import pyarrow.parquet as pq
        self.n = pq.ParquetDataset(uri).read(columns=["label"]).num_rows
        self.blobs = None

    def __len__(self):
        return self.n

    def _load(self):
        import pyarrow.parquet as pq
        t = pq.ParquetDataset(self.uri).read(columns=["image", "label"])
        self.blobs = t.column("image").to_pylist()
        self.labels = t.column("label").to_numpy()

    def __getitem__(self, i):
        import numpy as np
        import simplejpeg
        import torch
        from PIL import Image
        if self.blobs is None:
            self._load()
        img = simplejpeg.decode_jpeg(self.blobs[i], colorspace="RGB")
        rng = np.random                                   # seeded per worker by torch
        if self.crop == "random_crop":                    # pad 4, random 32x32, flip
            padded = np.pad(img, ((4, 4), (4, 4), (0, 0)))
            t, l = rng.randint(0, 9, 2)
            img = padded[t:t + self.size, l:l + self.size]
        else:                                             # random resized crop, torchvision's box
            H, W = img.shape[:2]
            for _ in range(10):
                area = H * W * rng.uniform(0.08, 1.0)
                ar = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
                w, h = int(round(np.sqrt(area * ar))), int(round(np.sqrt(area / ar)))
                if 0 < w <= W and 0 < h <= H:
                    t, l = rng.randint(0, H - h + 1), rng.randint(0, W - w + 1)
                    break
            else:
                t, l, h, w = 0, 0, H, W
            img = np.array(Image.fromarray(img).resize((self.size, self.size), Image.BILINEAR,
                                                         box=(l, t, l + w, t + h)))
        if rng.rand() < 0.5:
            img = img[:, ::-1]
        x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).float()
        x.sub_(self.mean).div_(self.std)
        return x, int(self.labels[i])


SKIP = 3     # batches of the timed epoch left out on both sides: torch's pipeline refills at
             # iter(), while ours reads across the epoch's edge (its first batches were ready)


def _steady(batches):
    """Images/s of an epoch's batches after its first SKIP: the same steady window for both
    loaders (timing from the epoch's start favoured ours by about a batch)."""
    n, t0 = 0, None
    for i, y in enumerate(batches):
        if i == SKIP - 1:
            t0 = time.perf_counter()
        elif i >= SKIP:
            n += len(y)
    return n / (time.perf_counter() - t0)


def time_torch(uri, size, crop, batch, workers, mean, std):
    import torch
    ds = ParquetJPEG(uri, size, crop, torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1))
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                     persistent_workers=True, drop_last=True)
    for _ in dl:                                          # warm-up epoch: workers start, load the files
        pass
    rate = _steady(y for _, y in dl)
    del dl
    return rate


def _source(uri, size, crop, workers):
    from training.data import ParquetSource
    import conf
    ops = [{"random_crop": {"size": size, "padding": 4}}, "hflip"] if crop == "random_crop" else \
        [{"random_resized_crop": {"size": size}}, "hflip"]
    job = {"name": "b", "groups": [{"name": "g", "instances": 1, "vcores": 1, "memory": "4 GiB"}],
           "training": {"data": {"train": uri, "augment": ops, "workers": workers, "memory": "1 GiB"}}}
    return ParquetSource(uri, conf.load_job(job).training.data)


def time_ours(uri, size, crop, batch, workers):
    it = _source(uri, size, crop, workers).batches(batch, 0, batch, seed=0, epochs=2)
    return _steady(y for e, s, x, y in it if e == 1)      # the second epoch, as torch's


def part_loader(args, home, rounds):
    import torch
    torch.set_num_threads(1)
    from training.data import import_synthetic_cifar
    cifar = os.path.join(home, "cifar-jpeg")
    import_synthetic_cifar(cifar, n_train=6000 if args.quick else 20000, n_test=100, encoding="jpeg")
    big = os.path.join(home, "photos")
    write_photos(big, 500 if args.quick else 2000)
    cases = [("32x32", f"{cifar}/train", 32, "random_crop", 256), ("224x224", big, 224, "random_resized_crop", 64)]
    got = {}
    norm = {}                                             # torch normalises as ours does
    for name, uri, size, crop, _ in cases:
        src = _source(uri, size, crop, args.workers)
        src._resolve_stats()                              # (else on its first batch)
        norm[name] = (src.mean.tolist(), src.std.tolist())
    for r in range(rounds):
        for name, uri, size, crop, batch in (cases if r % 2 == 0 else cases[::-1]):
            if r % 2:                                     # each goes first in every other round
                theirs = time_torch(uri, size, crop, batch, args.workers, *norm[name])
                ours = time_ours(uri, size, crop, batch, args.workers)
            else:
                ours = time_ours(uri, size, crop, batch, args.workers)
                theirs = time_torch(uri, size, crop, batch, args.workers, *norm[name])
            got.setdefault(name, []).append((ours, theirs))
            print(f"round {r + 1}: {name}: ours {ours:.0f} img/s, torch DataLoader {theirs:.0f} img/s", flush=True)
    rows = []
    for name, runs in got.items():
        o, t = statistics.median(x[0] for x in runs), statistics.median(x[1] for x in runs)
        rows.append({"part": "loader", "case": name, "workers": args.workers, "ours_img_s": o, "torch_img_s": t,
                     "ratio": statistics.median(a / b for a, b in runs), "runs": runs})   # of each round's
    return rows


# ----------------------------------------------------------------------------- jobs

def part_wait(args, home, rounds):
    from training.data import import_synthetic_cifar
    data = os.path.join(home, "wait-jpeg")
    import_synthetic_cifar(data, n_train=20000, n_test=100, encoding="jpeg")
    steps = 30 if args.quick else args.steps
    job = {"name": "data-wait", "max_restarts": 0,
           "groups": [{"name": "w", "instances": 2, "vcores": 1, "memory": "2 GiB"}],
           "training": {"model": "resnet", "batch_size": 128, "max_steps": steps, "epochs": 10, "log_every": 10,
                        "data": {"train": f"{data}/train",
                                 "augment": [{"random_crop": {"size": 32, "padding": 4}}, "hflip"]}},
           "checkpoint": {"uri": os.path.join(home, "wait-ckpt"), "every_steps": None}}
    runs = []
    for r in range(rounds):
        shutil.rmtree(os.path.join(home, "wait-ckpt"), ignore_errors=True)
        final = common.submit(job)["final"]
        runs.append({"data_wait_pct": final["data_wait_pct"], "samples_per_s": final["samples_per_s"]})
        print(f"round {r + 1}: ResNet-20, JPEG, 2 x 1 vcore: data wait {final['data_wait_pct']:.2f}% of the step, "
              f"{final['samples_per_s']:.0f} samples/s", flush=True)
    return [{"part": "wait", "case": "resnet20 cifar-jpeg 2x1vcore", "steps": steps,
             "data_wait_pct": statistics.median(r["data_wait_pct"] for r in runs),
             "samples_per_s": statistics.median(r["samples_per_s"] for r in runs), "runs": runs}]


def predicted_amplification(src, weights, B):
    """Bytes of the blocks the ranks touch in an epoch / dataset bytes, from the order
    (each block read once per epoch by each rank that touches it): with block-ordered
    slices (ours), and with slices drawn at random from each batch."""
    import numpy as np
    from training.data import split_rows
    o = src.order
    sizes = np.array([b.read_bytes for b in src.layout.blocks])
    counts = split_rows(B, weights)
    cuts = np.concatenate([[0], np.cumsum(counts)])
    ordered = sum(sizes[np.unique(o.plan(0, 0, B, lo, hi).blocks)].sum() for lo, hi in zip(cuts, cuts[1:]))
    rng = np.random.default_rng(0)
    p = o.plan(0, 0, B, 0, B)
    touched = [set() for _ in counts]
    for i in range(p.steps):
        _, bl = p.step(i)
        bl = rng.permutation(bl)
        for r, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
            touched[r].update(bl[lo:hi].tolist())
    rnd = sum(sizes[list(t)].sum() for t in touched)
    return ordered / sizes.sum(), rnd / sizes.sum()


def part_shuffle(args, home, rounds):
    from training.data import ParquetSource, import_synthetic_cifar
    data = os.path.join(home, "shuffle-raw")
    rows = 20000 if args.quick else args.rows
    import_synthetic_cifar(data, n_train=rows, n_test=100, shards=4)
    job = {"name": "shuffle", "max_restarts": 0,
           "groups": [{"name": "big", "instances": 1, "vcores": 1, "memory": "1 GiB"},
                      {"name": "small", "instances": 2, "vcores": 0.5, "memory": "1 GiB"}],
           "training": {"model": "mlp", "model_options": {"hidden": 64, "layers": 1}, "batch_size": 256,
                        "epochs": 1, "shares": "vcores", "log_every": 1, "data": {"train": f"{data}/train"}},
           "checkpoint": {"uri": os.path.join(home, "shuffle-ckpt"), "every_steps": None}}
    import conf
    src = ParquetSource(f"{data}/train", conf.load_job(job).training.data)      # the job's window
    predicted, at_random = predicted_amplification(src, [1, 0.5, 0.5], 256)
    runs = []
    for r in range(rounds):
        shutil.rmtree(os.path.join(home, "shuffle-ckpt"), ignore_errors=True)
        st = common.submit(job)
        prog = [st["progress"][k] for k in sorted(st["progress"])]
        amp = sum(p["data_read_mb"] for p in prog) * 1e6 / src.nbytes
        runs.append({"amplification": amp, "ranks": [
            {k: p.get(k) for k in ("data_read_mb", "data_rereads", "data_blocks_peak_mib", "memory_limit_mib",
                                   "memory_peak_mib", "container_rss_peak_mib", "rss_peak_mib")} for p in prog]})
        print(f"round {r + 1}: read amplification {amp:.3f}; memory peaks (MiB, rss+mapped / max_usage): "
              + ", ".join(f"rank {i} {p['container_rss_peak_mib']}/{p['memory_peak_mib']}" for i, p in enumerate(prog)),
              flush=True)
    return [{"part": "shuffle", "case": f"{rows} rows raw 3x32x32, {src.nbytes / 2 ** 20:.0f} MiB, "
                                        f"{len(src.layout.blocks)} blocks, 1x1 + 2x0.5 vcore, shares vcores",
             "amplification": statistics.median(r["amplification"] for r in runs),
             "predicted": predicted, "random_slices": at_random, "runs": runs}]


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    parts = args.parts.split(",")
    rounds = 1 if args.quick else args.repeat
    home = tempfile.mkdtemp(prefix="yarnapp-bench-")
    os.environ["YARNAPP_HOME"] = os.path.join(home, "home")
    sys.path.insert(0, ROOT)
    t0 = time.time()
    rows = []
    try:
        for part, fn in (("loader", part_loader), ("wait", part_wait), ("shuffle", part_shuffle)):
            if part in parts:
                rows += fn(args, home, rounds)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(f"\n{'part':<8} {'case':<34} result")
    for r in rows:
        if r["part"] == "loader":
            res = f"ours {r['ours_img_s']:.0f} img/s, torch {r['torch_img_s']:.0f} img/s: {r['ratio']:.2f}x"
        elif r["part"] == "wait":
            res = f"data wait {r['data_wait_pct']:.2f}% of the step ({r['samples_per_s']:.0f} samples/s)"
        else:
            res = (f"read amplification {r['amplification']:.3f} (the order predicts {r['predicted']:.3f}; "
                   f"slices at random from each batch: {r['random_slices']:.2f})")
        print(f"{r['part']:<8} {r['case'][:34]:<34} {res}")
    meta = {**common.machine_meta(), "rounds": rounds, "quick": args.quick, "workers": args.workers,
            "wall_s": round(time.time() - t0, 1)}
    common.write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
