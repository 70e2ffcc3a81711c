"""The fast chunked Gated DeltaNet form's rounding (kernels/gdn.cu, GdnForm::ChunkedFast) in pure
Python, against the exact f64 recurrence: how far its bf16 operands (W, U, decayed K, the chunk
states S_c, V' and the intra-chunk A; q and k are hi + lo pairs) and bf16 output take it, measured as the GPU tests do
(max abs error over max |exact|; tests/gpu/hybrid.rs holds outputs and states to 1e-2).

    python3 tests/reference/gdn_bf16_rounding.py [SEED] [DIM] [TOKENS]

Inputs as tests/gpu/hybrid.rs's gdn_inputs (unit q scaled by dk^-0.5, unit k, decays exp(-0.005)
to exp(-0.7), beta in [0.05, 0.95] rounded to bf16) with a given state (0.1 scale); one head,
dk = dv = DIM (default 128), one sequence of TOKENS (default 200). Every product is exact (f64)
apart from the modelled roundings: the kernels' f32 accumulators and the prep's f32 inverse are
taken as exact; the prep's products (K K^T, W, U) drop the lo x lo term of their bf16 hi + lo
operands (k, v, the scaled inverse) as the kernel does. No numpy needed.
"""
import math, random, struct, sys
def bf(x):
    b = struct.unpack('<I', struct.pack('<f', x))[0]
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return struct.unpack('<f', struct.pack('<I', b))[0]
def f32(x): return struct.unpack('<f', struct.pack('<f', x))[0]
random.seed(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
dk = dv = int(sys.argv[2]) if len(sys.argv) > 2 else 128
T = int(sys.argv[3]) if len(sys.argv) > 3 else 200
C = 64
def unit(scale):
    r = [random.uniform(-1, 1) for _ in range(dk)]; n = math.sqrt(sum(x*x for x in r))
    return [x / n * scale for x in r]
q = [unit(1 / math.sqrt(dk)) for _ in range(T)]
k = [unit(1.0) for _ in range(T)]
v = [[random.uniform(-1, 1) for _ in range(dv)] for _ in range(T)]
g = [-(0.005 + 0.7 * random.random() * random.random()) for _ in range(T)]
beta = [bf(0.05 + 0.9 * random.random()) for _ in range(T)]
S0 = [[random.uniform(-1, 1) * 0.1 for _ in range(dv)] for _ in range(dk)]
def dot(a, b): return sum(x * y for x, y in zip(a, b))
def split(M):
    H = [[bf(x) for x in r] for r in M]
    return H, [[bf(x - h) for x, h in zip(r, hr)] for r, hr in zip(M, H)]
def dot3(ah, al, bh, bl):
    return sum(a * b + a * d + c * b for a, c, b, d in zip(ah, al, bh, bl))
# exact recurrent (f64)
S = [row[:] for row in S0]; o_ref = []
for t in range(T):
    d = math.exp(g[t])
    for i in range(dk):
        S[i] = [x * d for x in S[i]]
    kv = [sum(S[i][c] * k[t][i] for i in range(dk)) for c in range(dv)]
    delta = [beta[t] * (v[t][c] - kv[c]) for c in range(dv)]
    for i in range(dk):
        ki = k[t][i]
        S[i] = [S[i][c] + ki * delta[c] for c in range(dv)]
    o_ref.append([sum(S[i][c] * q[t][i] for i in range(dk)) for c in range(dv)])
S_ref = S
# fast form simulation
S = [row[:] for row in S0]; o_fast = []
for c0 in range(0, T, C):
    L = min(C, T - c0)
    G = []; acc = 0.0
    for i in range(L): acc = f32(acc + g[c0 + i]); G.append(acc)
    K = k[c0:c0 + L]; Q = q[c0:c0 + L]; V = v[c0:c0 + L]; B = beta[c0:c0 + L]
    # prep: k, v and the scaled inverse as bf16 hi + lo pairs, each product hi hi + hi lo + lo hi
    # (lo lo dropped); the f32 inverse and accumulators taken as exact.
    Kh, Kl = split(K); Vh, Vl = split(V)
    A = [[B[i] * dot3(Kh[i], Kl[i], Kh[j], Kl[j]) * math.exp(G[i] - G[j]) if j < i else 0.0
          for j in range(L)] for i in range(L)]
    Ai = []  # (I + A)^-1 by rows
    for i in range(L):
        r = [0.0] * L; r[i] = 1.0
        for j in range(i):
            a = A[i][j]
            if a: r = [x - a * y for x, y in zip(r, Ai[j])]
        Ai.append(r)
    def apply(s, Xh, Xl):
        M = [[Ai[i][j] * s[j] for j in range(L)] for i in range(L)]
        Mh, Ml = split(M)
        XhT = [list(c) for c in zip(*Xh)]; XlT = [list(c) for c in zip(*Xl)]
        return [[dot3(Mh[i], Ml[i], XhT[c], XlT[c]) for c in range(len(XhT))] for i in range(L)]
    W = apply([B[j] * math.exp(G[j]) for j in range(L)], Kh, Kl)
    U = apply(B, Vh, Vl)
    Wb = [[bf(x) for x in r] for r in W]; Ub = [[bf(x) for x in r] for r in U]
    Ke = [[bf(math.exp(G[L - 1] - G[j]) * (h + l)) for h, l in zip(Kh[j], Kl[j])] for j in range(L)]
    Sc = [[bf(x) for x in r] for r in S]
    ScT = [list(col) for col in zip(*Sc)]
    Vp = [[bf(Ub[i][c] - dot(Wb[i], ScT[c])) for c in range(dv)] for i in range(L)]
    # output
    # q and k as bf16 hi + lo pairs (~16 mantissa bits): taken as exact.
    Qb = Q; Kb = K
    for i in range(L):
        a = [bf(dot(Qb[i], Kb[j]) * math.exp(G[i] - G[j])) for j in range(i + 1)]
        qs = [dot(Qb[i], ScT[c]) for c in range(dv)]
        eg = math.exp(G[i])
        o_fast.append([bf(eg * qs[c] + sum(a[j] * Vp[j][c] for j in range(i + 1))) for c in range(dv)])
    # state
    ed = math.exp(G[L - 1])
    KeT = [list(col) for col in zip(*Ke)]
    VpT = [list(col) for col in zip(*Vp)]
    S = [[ed * S[d][c] + dot(KeT[d], VpT[c]) for c in range(dv)] for d in range(dk)]
def rel(a, b):
    fa = [x for r in a for x in r]; fb = [x for r in b for x in r]
    return max(abs(x - y) for x, y in zip(fa, fb)) / max(abs(y) for y in fb)
print(f"dk=dv={dk} T={T}: out rel err {rel(o_fast, o_ref):.3e} (tol 1e-2), state rel err {rel(S, S_ref):.3e} (tol 1e-2)")
