// The instructions the native CPU ops run (w4a8.cpp, q8.cpp, fused_ops.cpp, decode_attention.cpp): torch's own CPU capability
// (ATEN_CPU_CAPABILITY lowers it) and the CPU's flags. 2: AVX-512 (with VNNI), 1: AVX2 (with FMA
// and F16C), 0: portable C++. Every op computes alike on each, so the choice changes speed only.
#pragma once

#include <ATen/Version.h>

#include <cstdint>
#include <string>

inline int64_t nim_cpu_isa() {
  static const int64_t chosen = [] {
    const std::string capability = at::get_cpu_capability();
    const bool avx512 = capability.rfind("AVX512", 0) == 0, avx2 = avx512 || capability == "AVX2";
    if (avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni")) return int64_t{2};
    if (avx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return int64_t{1};
    return int64_t{0};
  }();
  return chosen;
}

// NAME's copy for the chosen instructions (NAME_avx512, NAME_avx2 or NAME_portable: the same C++
// compiled for each target), called with the arguments that follow.
#define NIM_ISA_CALL(isa, NAME, ...)                                                  \
  ((isa) == 2 ? NAME##_avx512(__VA_ARGS__)                                           \
              : (isa) == 1 ? NAME##_avx2(__VA_ARGS__) : NAME##_portable(__VA_ARGS__))
