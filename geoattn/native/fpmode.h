// The thread's floating-point mode as the native kernels want it inside their parallel regions.

#pragma once

#include <cstdint>

#if defined(__SSE2__)
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr: the thread's MXCSR
#endif

// The kernels' own floating-point mode inside each of their parallel regions: subnormal inputs read
// as zero and subnormal results flushed to zero (DAZ and FTZ in x86's MXCSR, FZ in ARM's FPCR), the
// thread's mode restored on the way out. The kernels flush their small factors themselves (`flush`),
// so this changes no result; it keeps the rare subnormal product (in the BLAS or the elementwise
// work) from costing tens of times a normal one, whatever mode the calling threads are in.
class FlushSubnormals {
 public:
  FlushSubnormals() : saved_(read()) { write(saved_ | kBits); }
  ~FlushSubnormals() { write(saved_); }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

  // Whether the calling thread flushes now (for tests: the mode is restored after a call)
  static bool active() { return kBits != 0 && (read() & kBits) == kBits; }

 private:
#if defined(__SSE2__)
  using Word = unsigned int;
  static constexpr Word kBits = 0x8040;  // FTZ (bit 15) and DAZ (bit 6)
  static Word read() { return _mm_getcsr(); }
  static void write(Word w) { _mm_setcsr(w); }
#elif defined(__aarch64__)
  using Word = uint64_t;
  static constexpr Word kBits = Word(1) << 24;  // FZ
  static Word read() {
    Word w;
    asm volatile("mrs %0, fpcr" : "=r"(w));
    return w;
  }
  static void write(Word w) { asm volatile("msr fpcr, %0" : : "r"(w)); }
#else  // no known control register: the kernels' own flushing alone
  using Word = unsigned int;
  static constexpr Word kBits = 0;
  static Word read() { return 0; }
  static void write(Word) {}
#endif
  Word saved_;
};
