// What a busy-waiting thread does between two looks at shared state.
#pragma once

namespace fastpipe {

// Tells the core this is a spin loop (x86 `pause`, ARM `yield`): the
// sibling hyperthread gets the pipeline, and the loop's exit costs no
// memory-order mis-speculation.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace fastpipe
