// Which instruction set a kernel library was compiled for, so that Python can ask the library
// which of its paths runs (and tests can check that baseline mode built the AVX2 one).
#pragma once

extern "C" const char* kernel_isa() {
#if defined(__AMX_TILE__) && defined(__AVX512BF16__)
  return "amx";
#elif defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#elif defined(__aarch64__) || defined(__ARM_NEON)
  return "neon";
#else
  return "portable";
#endif
}
