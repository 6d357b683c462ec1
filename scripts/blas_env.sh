# Sourced by the scripts that run nextlm on the CPU (test.sh, run_example.sh).
# OpenBLAS 0.3.21 (Debian 12's) picks its kernels by CPU model and falls back to its generic Prescott kernels on x86
# cores it does not know (SSE3-era; OPENBLAS_VERBOSE=2 prints the choice), whose sums' order depends on the matrix
# shapes: a finite-difference check of the MoE router then lands just past its bound. Seen on a 2-core Xeon with
# AVX-512 that it reported as "Prescott". On a CPU with AVX-512 F, BW, DQ and VL the SkylakeX kernels are the right
# ones; an OPENBLAS_CORETYPE already set is kept.
if [ -z "${OPENBLAS_CORETYPE:-}" ] && [ -r /proc/cpuinfo ]; then
  blas_flags=" $(grep -m1 '^flags' /proc/cpuinfo || true) "
  if [[ $blas_flags == *" avx512f "* && $blas_flags == *" avx512bw "* && $blas_flags == *" avx512dq "* &&
        $blas_flags == *" avx512vl "* ]]; then
    export OPENBLAS_CORETYPE=SkylakeX
  fi
  unset blas_flags
fi
