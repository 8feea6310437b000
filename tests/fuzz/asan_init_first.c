/* Preloaded right after gcc's libasan into tritonserver, which is not built with AddressSanitizer
 * (tests/fuzz/sanitize.py, "native backend in tritonserver"): ASan starts before any library's
 * constructor calls newlocale().
 *
 * A program that is not built with ASan starts it lazily, at the first call ASan intercepts. In
 * tritonserver that is the malloc inside newlocale() in libp11-kit's constructor (a dependency of the
 * libcurl Triton links), made while glibc holds its locale lock for writing. ASan's start-up calls
 * dlerror(), whose message lookup takes that lock for reading on the same thread: glibc refuses it
 * (EDEADLK), releases it anyway, and the lock's reader count goes below zero. The embedded interpreter's
 * setlocale() at the first model load then waits for the lock forever. Started here, before glibc takes
 * the lock, ASan finds it free. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <locale.h>

void __asan_init(void); /* ASan's own start-up; returns at once after the first call */

typedef locale_t (*NewLocale)(int category_mask, const char *locale, locale_t base);

locale_t newlocale(int category_mask, const char *locale, locale_t base) {
    static NewLocale next;
    __asan_init();
    NewLocale found = __atomic_load_n(&next, __ATOMIC_ACQUIRE);
    if (found == NULL) {
        found = (NewLocale)dlsym(RTLD_NEXT, "newlocale");
        __atomic_store_n(&next, found, __ATOMIC_RELEASE);
    }
    return found(category_mask, locale, base);
}
