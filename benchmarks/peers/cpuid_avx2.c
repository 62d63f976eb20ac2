// LD_PRELOAD shim: this process and its children see an AVX2-only x86-64 CPU (a Zen 3 class one) in CPUID, so
// that every engine's own CPU dispatch (oneDNN, MLAS, OpenVINO's JIT, ggml, ATen's cpuinfo) picks its AVX2 code.
//
// Issue 34 lets "forced AVX2" stand in for an AVX2 machine only against peers capped the same way. Environment
// variables reach only some dispatchers (ONEDNN_MAX_CPU_ISA caps oneDNN, not MLAS or OpenVINO's own kernels), but
// all of them ask CPUID. Linux can make CPUID trap in user space (arch_prctl ARCH_SET_CPUID, where the CPU has
// "cpuid_fault"); the trap arrives as SIGSEGV, and the handler runs the real CPUID with trapping briefly off,
// clears the AVX-512 / AVX-VNNI / AMX bits and steps over the instruction. The setting is per thread and inherited
// by new threads and fork(); execve() resets it, and LD_PRELOAD brings the shim back into the new image.
//
//   gcc -O2 -shared -fPIC -o cpuid_avx2.so cpuid_avx2.c     (benchmarks/peers/avx2_cap.sh builds and uses it)
//
// Without CPUID faulting the shim refuses to run the program rather than let it run uncapped. glibc picked its
// string functions from CPUID before this constructor ran: avx2_cap.sh caps those with GLIBC_TUNABLES.

#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#ifndef ARCH_SET_CPUID
#define ARCH_SET_CPUID 0x1012
#endif

static struct sigaction previous;

static long set_cpuid_enabled(int on) { return syscall(SYS_arch_prctl, ARCH_SET_CPUID, on); }

static void bits_off(uint32_t* r, const int* bits, int n) {
  for (int i = 0; i < n; ++i) *r &= ~(1u << bits[i]);
}

// What an AVX2-only CPU reports: leaf 7.0 without the AVX-512 family, GFNI (Zen 4+) and AMX; leaf 7.1 (AVX-VNNI,
// AVX512_BF16, AVX-IFMA, AVX10, ...) empty, as on Zen 3.
static void cap(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
  if (leaf == 7 && sub == 0) {
    static const int ebx[] = {16, 17, 21, 26, 27, 28, 30, 31};       // F DQ IFMA PF ER CD BW VL
    static const int ecx[] = {1, 6, 8, 11, 12, 14};                  // VBMI VBMI2 GFNI VNNI BITALG VPOPCNTDQ
    static const int edx[] = {2, 3, 8, 22, 23, 24, 25};              // 4VNNIW 4FMAPS VP2INTERSECT AMX-BF16 FP16 AMX-TILE AMX-INT8
    bits_off(&r[1], ebx, sizeof ebx / sizeof *ebx);
    bits_off(&r[2], ecx, sizeof ecx / sizeof *ecx);
    bits_off(&r[3], edx, sizeof edx / sizeof *edx);
  } else if (leaf == 7 && sub == 1) {
    r[0] = r[1] = r[2] = r[3] = 0;
  } else if (leaf == 0x1d || leaf == 0x1e || leaf == 0x24) {  // AMX tile and AVX10 leaves
    r[0] = r[1] = r[2] = r[3] = 0;
  }
}

static void on_segv(int sig, siginfo_t* info, void* uctx) {
  ucontext_t* ctx = (ucontext_t*)uctx;
  greg_t* g = ctx->uc_mcontext.gregs;
  const unsigned char* ip = (const unsigned char*)g[REG_RIP];
  // A trapped CPUID is a general-protection fault (SI_KERNEL) at a 0F A2.
  if (info->si_code == SI_KERNEL && ip[0] == 0x0f && ip[1] == 0xa2) {
    const uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX];
    uint32_t r[4];
    set_cpuid_enabled(1);
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
    set_cpuid_enabled(0);
    cap(leaf, sub, r);
    g[REG_RAX] = r[0];
    g[REG_RBX] = r[1];
    g[REG_RCX] = r[2];
    g[REG_RDX] = r[3];
    g[REG_RIP] += 2;
    return;
  }
  // Someone else's fault: give it to the previous handler (or the default action) by re-running the instruction.
  (void)sig;
  sigaction(SIGSEGV, &previous, NULL);
}

__attribute__((constructor)) static void cpuid_avx2_init(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &previous);
  if (set_cpuid_enabled(0) != 0) {
    static const char msg[] = "cpuid_avx2.so: this CPU or kernel cannot trap CPUID (no cpuid_fault): not capping\n";
    (void)!write(2, msg, sizeof msg - 1);
    _exit(97);
  }
}
