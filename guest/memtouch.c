/*
 * memtouch: a synthetic guest writer with a known pattern, for tests.
 * usage: memtouch SIZE_MIB PAGES_PER_TICK TICK_MS
 * Every tick it writes PAGES_PER_TICK consecutive pages of a SIZE_MIB buffer (wrapping around).
 * Each touched page gets word 0 = (iteration << 32) | page index; every 8th iteration the whole
 * page is rewritten with that value, otherwise only word 0 and one 64-byte block change. Once a
 * second it prints "memtouch iter=N" so the console shows its progress.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: memtouch SIZE_MIB PAGES_PER_TICK TICK_MS\n");
        return 2;
    }
    size_t size = (size_t)atol(argv[1]) << 20;
    size_t per_tick = (size_t)atol(argv[2]);
    long tick_ms = atol(argv[3]);
    size_t pages = size / 4096;
    uint64_t *buf = calloc(pages, 4096);
    if (!buf || pages == 0) {
        fprintf(stderr, "memtouch: cannot allocate %zu bytes\n", size);
        return 1;
    }
    memset(buf, 0, size);
    printf("TANDEM-READY workload=memtouch\n");
    fflush(stdout);
    struct timespec ts = {tick_ms / 1000, (tick_ms % 1000) * 1000000L};
    uint64_t iter = 0;
    size_t cursor = 0;
    long ticks_per_sec = tick_ms > 0 ? 1000 / tick_ms : 1000;
    for (;;) {
        for (size_t i = 0; i < per_tick; i++) {
            size_t p = cursor;
            cursor = (cursor + 1) % pages;
            uint64_t *page = buf + p * 512;
            uint64_t v = (iter << 32) | p;
            if (iter % 8 == 0) {
                for (size_t w = 0; w < 512; w++) page[w] = v ^ w;
            } else {
                page[0] = v;
                size_t blk = (iter % 63 + 1) * 8;
                for (size_t w = 0; w < 8; w++) page[blk + w] = v + w;
            }
        }
        iter++;
        if (ticks_per_sec > 0 && iter % ticks_per_sec == 0) {
            printf("memtouch iter=%llu\n", (unsigned long long)iter);
            fflush(stdout);
        }
        nanosleep(&ts, NULL);
    }
}
