"""The Triton codec's kernels run on CPU under the Triton interpreter (``TRITON_INTERPRET=1``).

Each check runs in a fresh subprocess (the variable must be set before the kernels are defined) on
small buckets and compares against the torch reference codec on CPU. Under the interpreter the codec
casts to FP8 in software (the interpreter's own FP8 cast drops the carry into the exponent), so
payload bytes and scales must match exactly; bf16 outputs get one bf16 ulp because the interpreter
truncates fp32 -> bf16. Skipped when triton is not installed (CI has torch only).
"""
import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECKS = ["soft_cast", "encode", "reduce_decode", "primitives", "nonfinite", "stochastic", "segment_classes",
          "segment_lanes"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the interpreter test needs it "
                                           "(pip install triton); CI installs torch only")
@pytest.mark.parametrize("check", CHECKS)
def test_under_interpreter(check):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), check], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreter check {check!r} failed:\n{out[-6000:]}"
    assert f"CHECK {check} OK" in proc.stdout, out[-6000:]


# --------------------------------------------------------------------------- child side
def _child(check):  # pragma: no cover - runs in the subprocess
    sys.path.insert(0, ROOT)
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import math

    import torch
    import triton
    import triton.language as tl

    from fp8_comm_hook.codec.torch_codec import TorchCodec
    from fp8_comm_hook.codec import triton_kernels as tcmod
    from fp8_comm_hook.codec.triton_codec import TritonCodec
    from fp8_comm_hook.formats import get_format
    from fp8_comm_hook.layout import BucketLayout

    torch.manual_seed(0)
    torch.set_num_threads(1)
    SCALINGS, FMTS = ("block", "tensor", "bucket"), ("e4m3", "e5m2")

    def layout(numels, W, rank, scaling, dtype=torch.float32, bs=128):
        offs, o = [], 0
        for n in numels:
            offs.append(o)
            o += n
        return BucketLayout(numels, offs, [f"p{i}" for i in range(len(numels))], W, rank, bs, scaling, o, dtype,
                            "cpu"), o

    def sample(n, dtype=torch.float32, kind="gauss"):
        if kind == "gauss":
            x = torch.randn(n)
        elif kind == "heavy":
            x = torch.distributions.StudentT(2.0).sample((n,))
        else:
            x = torch.randn(n) * 1e-3
            if n:
                x[torch.randint(0, n, (max(1, n // 97),))] = 300.0
        return x.to(dtype)

    def encode_pair(numels, W, scaling, dtype, bs, with_res, fmt):
        """The torch and the Triton codec encode the same bucket (and residual) into two layouts of
        rank W - 1; the Triton side's send buffer starts as 0xFF, so that a byte the kernels skip
        (padding included) differs. Returns (torch layout, Triton layout, numel, residuals)."""
        La, n = layout(numels, W, W - 1, scaling, dtype, bs)
        Lb, _ = layout(numels, W, W - 1, scaling, dtype, bs)
        flat = sample(n, dtype, ("gauss", "heavy", "outlier")[len(numels) % 3])
        ra = rb = None
        if with_res:
            ra = La.ensure_residual()
            for i in range(len(numels)):
                La.segment(ra, i).copy_(torch.randn(numels[i]) * 0.01)
            rb = Lb.ensure_residual()
            rb.copy_(ra)
        TorchCodec(fmt).encode(flat, La, ra)
        Lb.send.fill_(0xFF)
        TritonCodec(fmt).encode(flat, Lb, rb)
        return La, Lb, n, ra, rb

    def same_bytes(a, b, what):
        assert a.shape == b.shape, (what, a.shape, b.shape)
        if not torch.equal(a, b):
            d = (a != b).nonzero()
            raise AssertionError(f"{what}: {d.shape[0]} bytes differ, first at {d[:5].tolist()}")

    if check == "soft_cast":
        globals()["tcmod"] = tcmod  # the kernel below resolves it from this module's globals
        @triton.jit
        def cast_kernel(x_ptr, o_ptr, n, MBITS: tl.constexpr, MIN_EXP: tl.constexpr, BIAS: tl.constexpr,
                        BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = i < n
            tl.store(o_ptr + i, tcmod._soft_fp8_bits(tl.load(x_ptr + i, mask=m, other=0.0), MBITS, MIN_EXP, BIAS),
                     mask=m)

        for name in FMTS:
            fmt = get_format(name)
            grid = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
            grid = grid[torch.isfinite(grid)].unique()
            mids = (grid[1:] + grid[:-1]) / 2                 # exact ties: RNE picks the even code
            nudge = torch.cat([mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf))])
            rand = (torch.rand(20000) * 2 - 1) * fmt.fmax
            tiny = (torch.rand(4000) * 2 - 1) * float(grid[grid > 0].min()) * 4
            x = torch.cat([grid, mids, nudge, rand, tiny, torch.tensor([0.0, -0.0, fmt.fmax, -fmt.fmax])]).float()
            x = x.clamp(-fmt.fmax, fmt.fmax)
            out = torch.empty(x.numel(), dtype=torch.uint8)
            mbits, min_exp, bias = fmt.mantissa_bits, (-6 if name == "e4m3" else -14), (7 if name == "e4m3" else 15)
            cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), MBITS=mbits, MIN_EXP=min_exp,
                                                         BIAS=bias, BLOCK=1024)
            same_bytes(out, x.to(fmt.dtype).view(torch.uint8), f"soft cast {name}")

    elif check == "encode":
        # [256, 48] and [256, 40]: contiguous buckets whose length is a multiple of 16 and of 8 (SRC_AL)
        buckets = [[1], [127], [300, 1, 130, 77], [2000, 5, 129], [256, 48], [256, 40]]
        for scaling in SCALINGS:
            for name in FMTS:
                fmt = get_format(name)
                for dtype in (torch.float32, torch.bfloat16):
                    for numels in buckets:
                        for W, bs in ((2, 128), (3, 16)):
                            for with_res in (False, True):
                                La, Lb, n, ra, rb = encode_pair(numels, W, scaling, dtype, bs, with_res, fmt)
                                what = f"encode {scaling} {name} {dtype} {numels} W={W} bs={bs} res={with_res}"
                                same_bytes(Lb.send, La.send, what)
                                if with_res:
                                    assert torch.equal(ra, rb), what + ": residual differs"
                                # a second call reuses the plan and a new amax epoch
                                flat2 = sample(n, dtype)
                                TorchCodec(fmt).encode(flat2, La)
                                TritonCodec(fmt).encode(flat2, Lb)
                                same_bytes(Lb.send, La.send, what + " (second call)")

    elif check == "reduce_decode":
        for scaling in SCALINGS:
            for name in FMTS:
                fmt = get_format(name)
                for W in (2, 3, 5):  # 5: one unrolled round of the received sum plus a masked tail
                    numels = [700, 3, 129, 64]
                    rank = W - 1
                    La, n = layout(numels, W, rank, scaling)
                    Lb, _ = layout(numels, W, rank, scaling)
                    tc = TorchCodec(fmt)
                    for s in range(W):  # chunk `rank` of W different ranks' buckets
                        tc.encode(sample(n, kind=("gauss", "heavy", "outlier")[s % 3]) * (s + 1), La)
                        La.recv[s].copy_(La.send[rank])
                    Lb.recv.copy_(La.recv)
                    ra = La.ensure_residual()
                    ra.normal_(0, 0.01)
                    rb = Lb.ensure_residual()
                    rb.copy_(ra)
                    tc.reduce_shard(La, ra)
                    TritonCodec(fmt).reduce_shard(Lb, rb)
                    what = f"reduce {scaling} {name} W={W}"
                    same_bytes(Lb.gather_in, La.gather_in, what)
                    torch.testing.assert_close(rb, ra, rtol=1e-6, atol=1e-6 * float(ra.abs().max()), msg=what)
                    for L in (La, Lb):   # every rank's requantized shard
                        L.gather_out.copy_(La.recv)
                        L.gather_out[rank].copy_(La.gather_in)
                    for dtype in (torch.float32, torch.bfloat16):
                        fa = torch.full((n,), 7.0, dtype=dtype)
                        fb = fa.clone()
                        tc.decode(La, fa)
                        TritonCodec(fmt).decode(Lb, fb)
                        if dtype == torch.float32:
                            assert torch.equal(fa, fb), f"decode {what} {dtype}"
                        else:  # the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest
                            torch.testing.assert_close(fb.float(), fa.float(), rtol=2 ** -7, atol=0,
                                                       msg=f"decode {what} {dtype}")

    elif check == "primitives":
        for scaling in SCALINGS:
            for name in FMTS:
                fmt = get_format(name)
                L, n = layout([500, 9, 260], 3, 0, scaling)
                g = L.groups
                x = L.gather_from(sample(n, kind="heavy"))
                outs = {}
                for codec in (TorchCodec(fmt), TritonCodec(fmt)):
                    amax = torch.zeros(g.num_groups)
                    codec.group_amax(x, g, L.work, L.block_amax, amax)
                    pay = torch.zeros(g.rows, g.chunk_numel, dtype=torch.uint8)
                    sinv = torch.zeros(g.rows, g.groups_per_row)
                    codec.quantize_with_amax(x, g, amax, pay, sinv, pre_scale=1 / math.sqrt(3), work=L.work,
                                             group_scale=L.group_scale, block_scale=L.block_scale)
                    deq = codec.dequantize(pay, sinv, g, torch.zeros(L.padded_numel), L.block_scale).clone()
                    s = codec.dequantize_sum(pay, sinv, g, torch.zeros(g.chunk_numel), L.work, L.block_scale).clone()
                    outs[codec.name] = (amax, pay, sinv, deq, s)
                for a, b, what in zip(outs["torch"], outs["triton"], ("amax", "payload", "scale_inv", "deq", "sum")):
                    assert torch.equal(a, b), f"primitive {what} {scaling} {name}"

    elif check == "nonfinite":
        for scaling in SCALINGS:
            for name in FMTS:
                fmt = get_format(name)
                numels = [1000, 5, 300]
                La, n = layout(numels, 2, 0, scaling)
                Lb, _ = layout(numels, 2, 0, scaling)
                flat = sample(n)
                flat[3] = math.inf
                flat[1002] = math.nan
                flat[1200] = -math.inf
                TorchCodec(fmt).encode(flat, La)
                TritonCodec(fmt).encode(flat, Lb)
                C = La.chunk_numel
                sa, sb = La.scales(La.send, C), Lb.scales(Lb.send, C)
                assert torch.equal(torch.isnan(sa), torch.isnan(sb)), f"nonfinite {scaling} {name}"
                assert int(torch.isnan(sb).sum()) > 0
                fin = ~torch.isnan(sa)
                assert torch.equal(sa[fin], sb[fin])

    elif check == "segment_classes":
        # One launch per alignment class of blocks (SEGMENT_CLASSES, off by default): full blocks
        # whose source offset is a multiple of 2, 4, 8 elements are read and written in vectors.
        from fp8_comm_hook.codec import triton_codec as tcodec
        tcodec.SEGMENT_CLASSES = True
        aligned_seen = set()
        plain_launch = TritonCodec._launch

        def record(kernel, grid, device, *args, **kwargs):
            if kwargs.get("LISTED"):
                aligned_seen.add(kwargs["SRC_AL"])
            return plain_launch(kernel, grid, device, *args, **kwargs)

        TritonCodec._launch = staticmethod(record)
        # parameters starting at offsets of every residue modulo 8, partial last blocks, tiny ones
        buckets = [[256, 130, 512, 8, 1000, 2, 640], [3, 1, 2, 7, 300], [2000, 5, 129], [127, 3]]
        for scaling in SCALINGS:
            for dtype in (torch.float32, torch.bfloat16):
                for numels in buckets:
                    for W, bs in ((2, 128), (3, 16)):
                        for with_res in (False, True):
                            La, Lb, n, ra, rb = encode_pair(numels, W, scaling, dtype, bs, with_res,
                                                            get_format("e4m3"))
                            what = f"classes {scaling} {dtype} {numels} W={W} bs={bs} res={with_res}"
                            same_bytes(Lb.send, La.send, "encode " + what)
                            if with_res:
                                assert torch.equal(ra, rb), what + ": residual differs"
                            La.gather_out.copy_(La.send)
                            Lb.gather_out.copy_(La.send)
                            fa = torch.full((n,), 7.0, dtype=dtype)
                            fb = fa.clone()
                            TorchCodec(get_format("e4m3")).decode(La, fa)
                            TritonCodec(get_format("e4m3")).decode(Lb, fb)
                            if dtype == torch.float32:
                                assert torch.equal(fa, fb), "decode " + what
                            else:
                                torch.testing.assert_close(fb.float(), fa.float(), rtol=2 ** -7, atol=0,
                                                           msg="decode " + what)
        assert aligned_seen >= {1, 2, 4, 8}, aligned_seen

    elif check == "segment_lanes":
        # Fewer lanes per block row in the segment-table encode (_SEGMENT_ENCODE_LANES) and decode
        # (_SEGMENT_LANES) of odd buckets: the same bytes as the torch codec.
        from fp8_comm_hook.codec import triton_codec as tcodec
        lanes_seen = set()
        plain_launch = TritonCodec._launch

        def record(kernel, grid, device, *args, **kwargs):
            if kwargs.get("SOURCE") == tcmod._SRC_SEGMENTS or kwargs.get("SEGMENTED"):
                lanes_seen.add(kwargs["LW"])
            return plain_launch(kernel, grid, device, *args, **kwargs)

        TritonCodec._launch = staticmethod(record)
        for enc_lanes, dec_lanes in ((16, 32), (8, 16)):
            tcodec._SEGMENT_ENCODE_LANES, tcodec._SEGMENT_LANES = enc_lanes, dec_lanes
            for scaling in SCALINGS:
                for dtype in (torch.float32, torch.bfloat16):
                    for numels in ([300, 1, 130, 77], [2000, 5, 129]):
                        La, Lb, n, _, _ = encode_pair(numels, 3, scaling, dtype, 128, False, get_format("e4m3"))
                        what = f"lanes {enc_lanes}/{dec_lanes} {scaling} {dtype} {numels}"
                        same_bytes(Lb.send, La.send, "encode " + what)
                        La.gather_out.copy_(La.send)
                        Lb.gather_out.copy_(La.send)
                        fa = torch.full((n,), 7.0, dtype=dtype)
                        fb = fa.clone()
                        TorchCodec(get_format("e4m3")).decode(La, fa)
                        TritonCodec(get_format("e4m3")).decode(Lb, fb)
                        if dtype == torch.float32:
                            assert torch.equal(fa, fb), "decode " + what
                        else:  # as in the checks above: one bf16 rounding step apart at most
                            torch.testing.assert_close(fb.float(), fa.float(), rtol=2 ** -7, atol=0,
                                                       msg="decode " + what)
        assert lanes_seen >= {8, 16, 32}, lanes_seen

    elif check == "stochastic":
        fmt = get_format("e4m3")
        numels = [1000, 37]
        L, n = layout(numels, 2, 0, "block")
        x = torch.randn(n)
        sr = TritonCodec(fmt, stochastic_rounding=True)
        g = torch.Generator().manual_seed(5)
        sr.encode(x, L, generator=g)
        first = L.send.clone()
        g.manual_seed(5)
        sr.encode(x, L, generator=g)
        assert torch.equal(first, L.send), "stochastic rounding must be deterministic for a seed"
        sr.encode(x, L, generator=g)
        assert not torch.equal(first, L.send), "the generator must advance between calls"
        C = L.chunk_numel
        deq = torch.empty(L.padded_numel)
        total = torch.zeros(n)
        reps = 48
        for i in range(reps):
            sr.encode(x, L, generator=torch.Generator().manual_seed(100 + i))
            sr.dequantize(L.payload(L.send, C), L.scales(L.send, C), L.groups, deq, L.block_scale)
            total += torch.cat([L.segment(deq, i) for i in range(len(numels))])
        rne = TritonCodec(fmt)
        rne.encode(x, L)
        rne.dequantize(L.payload(L.send, C), L.scales(L.send, C), L.groups, deq, L.block_scale)
        rne_x = torch.cat([L.segment(deq, i) for i in range(len(numels))])
        err_sr = float((total / reps - x).norm())
        err_rne = float((rne_x - x).norm())
        assert err_sr < err_rne, (err_sr, err_rne)
    else:
        raise SystemExit(f"unknown check {check}")
    print(f"CHECK {check} OK")


if __name__ == "__main__":
    _child(sys.argv[1])
