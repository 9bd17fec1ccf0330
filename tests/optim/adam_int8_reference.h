// The Python (numpy) reference of Adam with 8-bit states, shared by adam_int8_test.cpp and
// adam_kahan_test.cpp (bf16 masters with 8-bit moments).
#pragma once

namespace roundpipe::optim::test_reference {

// The reference: maps (bitsandbytes' create_dynamic_map, in double then rounded to float32),
// block-wise quantization (absmax per 256, x * (1 / absmax), nearest value with ties to the lower
// code = searchsorted over the midpoints) and the float32 Adam element math in the order of
// docs/optimizer.md, "Math". fma(a, b, c) is emulated in float64 (a*b is exact there; the sum
// rounds twice, which differs from one rounding with probability ~2^-29 per operation).
inline constexpr const char* kAdamInt8Reference = R"PY(
import math
import numpy as np
f32 = np.float32

def build_map(signed):
    scale = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]
    data = []
    for i in range(7):
        n = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        start = 0.1
        step = (1.0 - start) / (n - 1)
        b = [1.0 if k == n - 1 else start + k * step for k in range(n)]
        for k in range(n - 1):
            mean = (b[k] + b[k + 1]) / 2.0
            data.append(scale[i] * mean)
            if signed:
                data.append(-(scale[i] * mean))
    data += [0.0, 1.0]
    assert len(data) == 256
    values = np.sort(np.array(data, dtype=np.float64).astype(np.float32))
    thr = np.empty(256, dtype=np.float32)
    thr[:255] = (values[:-1] + values[1:]) * f32(0.5)
    thr[255] = np.inf
    return values, thr

def bnb_map(signed, max_exponent_bits=7, total_bits=8):
    # bitsandbytes.functional.create_dynamic_map, transcribed (float32 through torch.linspace).
    data = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                    else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data.sort()
    return torch.tensor(data, dtype=torch.float32)

MAPS = {True: build_map(True), False: build_map(False)}
BLOCK = 256

def dequant(codes, absmax, signed):
    values = MAPS[signed][0]
    return values[codes] * np.repeat(absmax, BLOCK)[:codes.size]

def quant(x, signed):
    thr = MAPS[signed][1]
    n = x.size
    nb = (n + BLOCK - 1) // BLOCK
    pad = np.zeros(nb * BLOCK, dtype=np.float32)
    pad[:n] = np.abs(x)
    absmax = pad.reshape(nb, BLOCK).max(axis=1)
    safe = np.where(absmax > 0, absmax, f32(1))
    inv = np.where(absmax > 0, f32(1) / safe, f32(0)).astype(np.float32)
    codes = np.searchsorted(thr, x * np.repeat(inv, BLOCK)[:n], side='left').astype(np.uint8)
    return codes, absmax

def fma(a, b, c):
    return (np.float64(a) * np.asarray(b, dtype=np.float64) + np.asarray(c, dtype=np.float64)).astype(np.float32)

def adam_math(p, g, m, v, step, lr, b1, b2, eps, wd, decoupled, maximize):
    bc1 = 1 - b1 ** step
    bc2 = 1 - b2 ** step
    w = f32(1 - b1)
    from_grad = not (abs(w) < f32(0.5))
    coeff = f32(w - f32(1)) if from_grad else w
    if maximize:
        g = -g
    if wd != 0:
        if decoupled:
            p = p * f32(1 - lr * wd)
        else:
            g = fma(p, f32(wd), g)
    m = fma(coeff, g - m, g if from_grad else m)
    v = v * f32(b2)
    v = v + (f32(1 - b2) * g) * g
    denom = np.sqrt(v) / f32(math.sqrt(bc2)) + f32(eps)
    p = p + (f32(-(lr / bc1)) * m) / denom
    return p, m, v
)PY";

}  // namespace roundpipe::optim::test_reference
