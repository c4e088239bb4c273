"""An independent pure-Python rendering of docs/rht-signs.md, used as the tests' oracle."""

M32 = 0xFFFFFFFF


def mix(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & M32
    x ^= x >> 15
    return x


def key_words(job: int, tensor: int, step: int) -> tuple[int, int]:
    k = mix(job ^ 0x9E3779B9)
    k = mix(k ^ tensor)
    k = mix(k ^ (step & M32))
    k = mix(k ^ (step >> 32))
    return k, mix(k ^ 0x85EBCA6B)


def word(k0: int, k1: int, counter: int) -> int:
    return mix(mix(counter ^ k0) ^ k1)


def signs(job: int, tensor: int, step: int, d: int) -> list[int]:
    k0, k1 = key_words(job, tensor, step)
    out = []
    for i in range(d):
        bit = (word(k0, k1, i // 32) >> (i % 32)) & 1
        out.append(-1 if bit else 1)
    return out
