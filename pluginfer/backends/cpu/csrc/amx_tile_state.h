/* Asking Linux for the AMX tile data state (arch_prctl ARCH_REQ_XCOMP_PERM), once per library: amx_half.c and
 * amx_quant.c. Include it where AMX is compiled in, in a file that defines _GNU_SOURCE first (syscall() under
 * -std=c11). */
#pragma once

#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

/* 0: granted (now, or before: *granted set); otherwise the errno of the refusal. */
static inline int amx_request_tile_state(int *granted) {
    if (*granted) return 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return errno;
    *granted = 1;
    return 0;
}
