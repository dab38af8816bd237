/*
 * pagescan.c: the exact page scanner.
 *
 * For a set of processes, read /proc/PID/maps (the ranges), /proc/PID/pagemap
 * (8 bytes per virtual page: bit 63 present, bits 0-54 the PFN) and
 * /proc/kpagecount (8 bytes per PFN: how many times the page is mapped
 * system-wide), and classify each physical page once:
 *
 *   m  = mappings of the page within the set (process, virtual page pairs)
 *   kc = its kpagecount
 *   private         kc <= m and m == 1          (mapped once, by one process)
 *   shared_inside   kc <= m and m > 1           (every mapping is in the set)
 *   shared_outside  kc > m                      (mapped outside the set too)
 *
 * Pages with kc == 0 (the shared zero page, raw PFN mappings: nothing the
 * kernel counts) are skipped, as smaps' Rss skips them.  Per process, with d
 * the number of processes of the set that map the page: private when kc <= m
 * and d == 1, shared_inside when kc <= m and d > 1, shared_outside when kc > m.
 *
 * Speed: pagemap is read in large chunks per VMA, PFNs are deduplicated with
 * an open-addressing hash table, the unique PFNs are radix-sorted and
 * /proc/kpagecount is read in contiguous runs, skipping the pages pagemap
 * already flags as exclusively mapped (PM_MMAP_EXCLUSIVE, bit 56: the
 * kernel's mapcount == 1) that the set maps once: their kpagecount is 1.  The GIL is released while a
 * process is scanned and while kpagecount is read.
 */
#include "bunshin_c.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PM_PRESENT (1ULL << 63)
#define PM_MMAP_EXCLUSIVE (1ULL << 56)
#define PM_PFN_MASK ((1ULL << 55) - 1)
/* pagemap entries read per pread (512 KiB). */
#define PAGEMAP_CHUNK (64 * 1024)
/* kpagecount: merge two PFNs into one read when they are at most this far apart
 * (the kernel spends about 0.1 us per entry and 0.3 us per read). */
#define KPC_GAP 4
/* kpagecount entries read per pread at most (1 MiB). */
#define KPC_RUN_MAX (128 * 1024)

/* ------------------------------------------------------------------------ */
/* Open-addressing hash table keyed by PFN (0 marks an empty slot).        */

typedef struct {
    uint64_t pfn;
    uint32_t mapcount;   /* (process, virtual page) mappings within the set */
    int32_t last;        /* index of the last process of the set that mapped it */
    uint32_t nprocs;     /* distinct processes of the set that map it */
    uint32_t kpagecount; /* from /proc/kpagecount (saturated to 32 bits); while
                          * scanning, 1 if pagemap said "exclusively mapped" */
} pfn_slot;

typedef struct {
    pfn_slot *slots;
    size_t mask;
    size_t used;
    int bits;
} pfn_table;

static inline size_t
pfn_hash(uint64_t pfn, int bits)
{
    return (size_t)((pfn * 0x9E3779B97F4A7C15ULL) >> (64 - bits));
}

static int
table_init(pfn_table *t, int bits)
{
    t->bits = bits;
    t->mask = ((size_t)1 << bits) - 1;
    t->used = 0;
    t->slots = calloc(t->mask + 1, sizeof(pfn_slot));
    return t->slots != NULL ? 0 : -1;
}

static int
table_grow(pfn_table *t)
{
    pfn_table bigger;
    size_t i;

    if (table_init(&bigger, t->bits + 1) < 0)
        return -1;
    for (i = 0; i <= t->mask; i++) {
        pfn_slot *s = &t->slots[i];
        size_t h;
        if (s->pfn == 0)
            continue;
        h = pfn_hash(s->pfn, bigger.bits);
        while (bigger.slots[h].pfn != 0)
            h = (h + 1) & bigger.mask;
        bigger.slots[h] = *s;
    }
    bigger.used = t->used;
    free(t->slots);
    *t = bigger;
    return 0;
}

/* Return the slot of pfn, inserting it (mapcount 0, last -1) if absent. */
static inline pfn_slot *
table_upsert(pfn_table *t, uint64_t pfn)
{
    size_t h = pfn_hash(pfn, t->bits);

    for (;;) {
        pfn_slot *s = &t->slots[h];
        if (s->pfn == pfn)
            return s;
        if (s->pfn == 0) {
            if ((t->used + 1) * 2 > t->mask + 1) {
                if (table_grow(t) < 0)
                    return NULL;
                return table_upsert(t, pfn);
            }
            s->pfn = pfn;
            s->last = -1;
            t->used++;
            return s;
        }
        h = (h + 1) & t->mask;
    }
}

static inline pfn_slot *
table_find(const pfn_table *t, uint64_t pfn)
{
    size_t h = pfn_hash(pfn, t->bits);

    for (;;) {
        pfn_slot *s = &t->slots[h];
        if (s->pfn == pfn)
            return s;
        if (s->pfn == 0)
            return NULL;
        h = (h + 1) & t->mask;
    }
}

/* ------------------------------------------------------------------------ */
/* Scan state.                                                              */

typedef struct {
    pid_t pid;
    uint64_t *pfns; /* the unique PFNs this process maps */
    size_t len, cap;
    uint64_t resident, private_, shared_inside, shared_outside;
} proc_scan;

enum scan_error_kind { SCAN_OK = 0, SCAN_ERRNO, SCAN_VANISHED, SCAN_NO_PFN, SCAN_NOMEM };

typedef struct {
    enum scan_error_kind kind;
    int err;
    pid_t pid;
    char path[64];
} scan_error;

typedef struct {
    pfn_table table;
    uint64_t *buf; /* pagemap / kpagecount read buffer */
    size_t bufcap; /* in entries */
    char *maps;    /* /proc/PID/maps text */
    size_t mapscap;
    scan_error error;
} scan_ctx;

static void
scan_fail(scan_ctx *ctx, enum scan_error_kind kind, int err, pid_t pid, const char *path)
{
    ctx->error.kind = kind;
    ctx->error.err = err;
    ctx->error.pid = pid;
    snprintf(ctx->error.path, sizeof(ctx->error.path), "%s", path);
}

static int
proc_push(proc_scan *p, uint64_t pfn)
{
    if (p->len == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 4096;
        uint64_t *pfns = realloc(p->pfns, cap * sizeof(uint64_t));
        if (pfns == NULL)
            return -1;
        p->pfns = pfns;
        p->cap = cap;
    }
    p->pfns[p->len++] = pfn;
    return 0;
}

/* pread everything asked for (procfs may return less); returns bytes read or -1. */
static ssize_t
pread_full(int fd, void *buf, size_t len, off_t off)
{
    size_t done = 0;

    while (done < len) {
        ssize_t r = pread(fd, (char *)buf + done, len - done, off + (off_t)done);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (r == 0)
            break;
        done += (size_t)r;
    }
    return (ssize_t)done;
}

static int
open_proc(scan_ctx *ctx, pid_t pid, const char *what, char *path, size_t pathlen)
{
    int fd;

    snprintf(path, pathlen, "/proc/%d/%s", (int)pid, what);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT || errno == ESRCH)
            scan_fail(ctx, SCAN_VANISHED, ESRCH, pid, path);
        else
            scan_fail(ctx, SCAN_ERRNO, errno, pid, path);
    }
    return fd;
}

/* Read /proc/PID/maps into ctx->maps; returns its length or -1. */
static ssize_t
read_maps(scan_ctx *ctx, pid_t pid)
{
    char path[64];
    size_t len = 0;
    int fd = open_proc(ctx, pid, "maps", path, sizeof(path));

    if (fd < 0)
        return -1;
    for (;;) {
        ssize_t r;
        if (ctx->mapscap - len < 4096) {
            size_t cap = ctx->mapscap ? ctx->mapscap * 2 : 65536;
            char *maps = realloc(ctx->maps, cap);
            if (maps == NULL) {
                scan_fail(ctx, SCAN_NOMEM, ENOMEM, pid, path);
                goto error;
            }
            ctx->maps = maps;
            ctx->mapscap = cap;
        }
        r = read(fd, ctx->maps + len, ctx->mapscap - len - 1);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            scan_fail(ctx, errno == ESRCH ? SCAN_VANISHED : SCAN_ERRNO, errno, pid, path);
            goto error;
        }
        if (r == 0)
            break;
        len += (size_t)r;
    }
    ctx->maps[len] = '\0';
    close(fd);
    return (ssize_t)len;
error:
    close(fd);
    return -1;
}

/* Scan one process (index idx of the set); runs without the GIL. */
static int
scan_process(scan_ctx *ctx, proc_scan *proc, int32_t idx, long page_size)
{
    char path[64];
    uint64_t present = 0, with_pfn = 0;
    ssize_t maps_len;
    char *line, *end;
    int fd = -1;

    maps_len = read_maps(ctx, proc->pid);
    if (maps_len < 0)
        goto error;
    fd = open_proc(ctx, proc->pid, "pagemap", path, sizeof(path));
    if (fd < 0)
        goto error;

    end = ctx->maps + maps_len;
    for (line = ctx->maps; line < end;) {
        char *eol = memchr(line, '\n', (size_t)(end - line));
        char *p = line;
        uint64_t start, stop, page, npages;

        if (eol == NULL)
            eol = end;
        start = strtoull(p, &p, 16);
        stop = (*p == '-') ? strtoull(p + 1, &p, 16) : 0;
        if (stop <= start || (eol - line >= 10 && memcmp(eol - 10, "[vsyscall]", 10) == 0)) {
            line = eol + 1;
            continue;
        }
        page = start / (uint64_t)page_size;
        npages = (stop - start) / (uint64_t)page_size;
        while (npages > 0) {
            size_t want = npages < ctx->bufcap ? (size_t)npages : ctx->bufcap;
            ssize_t got = pread_full(fd, ctx->buf, want * 8, (off_t)(page * 8));
            size_t n, i;
            if (got < 0) {
                scan_fail(ctx, errno == ESRCH ? SCAN_VANISHED : SCAN_ERRNO, errno,
                          proc->pid, path);
                goto error;
            }
            n = (size_t)got / 8;
            if (n == 0) {
                /* the address space is gone: the process exited */
                scan_fail(ctx, SCAN_VANISHED, ESRCH, proc->pid, path);
                goto error;
            }
            for (i = 0; i < n; i++) {
                uint64_t e = ctx->buf[i], pfn;
                pfn_slot *s;
                if (!(e & PM_PRESENT))
                    continue;
                present++;
                pfn = e & PM_PFN_MASK;
                if (pfn == 0)
                    continue;
                with_pfn++;
                s = table_upsert(&ctx->table, pfn);
                if (s == NULL)
                    goto nomem;
                s->mapcount++;
                if (e & PM_MMAP_EXCLUSIVE)
                    s->kpagecount = 1;
                if (s->last != idx) {
                    s->last = idx;
                    s->nprocs++;
                    if (proc_push(proc, pfn) < 0)
                        goto nomem;
                }
            }
            page += n;
            npages -= n;
        }
        line = eol + 1;
    }
    if (present > 0 && with_pfn == 0) {
        scan_fail(ctx, SCAN_NO_PFN, EPERM, proc->pid, path);
        goto error;
    }
    close(fd);
    return 0;
nomem:
    scan_fail(ctx, SCAN_NOMEM, ENOMEM, proc->pid, path);
error:
    if (fd >= 0)
        close(fd);
    return -1;
}

/* LSD radix sort of n PFNs (11-bit digits, only as many passes as needed). */
static int
radix_sort(uint64_t *a, size_t n)
{
    uint64_t *tmp, max = 0, *src = a, *dst;
    size_t i;
    int shift;

    for (i = 0; i < n; i++)
        if (a[i] > max)
            max = a[i];
    tmp = malloc((n ? n : 1) * sizeof(uint64_t));
    if (tmp == NULL)
        return -1;
    dst = tmp;
    for (shift = 0; shift < 64 && (max >> shift) != 0; shift += 11) {
        size_t count[2048] = {0}, sum = 0;
        uint64_t *swap;
        for (i = 0; i < n; i++)
            count[(src[i] >> shift) & 2047]++;
        for (i = 0; i < 2048; i++) {
            size_t c = count[i];
            count[i] = sum;
            sum += c;
        }
        for (i = 0; i < n; i++)
            dst[count[(src[i] >> shift) & 2047]++] = src[i];
        swap = src;
        src = dst;
        dst = swap;
    }
    if (src != a)
        memcpy(a, src, n * sizeof(uint64_t));
    free(tmp);
    return 0;
}

/* Fill kpagecount for every slot, reading contiguous runs; without the GIL. */
static int
read_kpagecounts(scan_ctx *ctx)
{
    const char *path = "/proc/kpagecount";
    pfn_table *t = &ctx->table;
    uint64_t *pfns = NULL;
    size_t n = 0, i, j;
    int fd = -1;

    if (t->used == 0)
        return 0;
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        scan_fail(ctx, SCAN_ERRNO, errno, 0, path);
        goto error;
    }
    pfns = malloc(t->used * sizeof(uint64_t));
    if (pfns == NULL)
        goto nomem;
    /* A page pagemap called exclusively mapped (PM_MMAP_EXCLUSIVE, the kernel's
     * own "mapcount == 1") that the set maps once has kpagecount 1: no read. */
    for (i = 0; i <= t->mask; i++) {
        pfn_slot *s = &t->slots[i];
        if (s->pfn == 0)
            continue;
        if (s->kpagecount == 1 && s->mapcount == 1)
            continue;
        pfns[n++] = s->pfn;
    }
    if (radix_sort(pfns, n) < 0)
        goto nomem;

    for (i = 0; i < n; i = j) {
        uint64_t first = pfns[i], count;
        ssize_t got;
        size_t k, avail;
        for (j = i + 1; j < n && pfns[j] - pfns[j - 1] <= KPC_GAP &&
                        pfns[j] - first < KPC_RUN_MAX; j++)
            ;
        count = pfns[j - 1] - first + 1;
        got = pread_full(fd, ctx->buf, (size_t)count * 8, (off_t)(first * 8));
        if (got < 0) {
            scan_fail(ctx, SCAN_ERRNO, errno, 0, path);
            goto error;
        }
        avail = (size_t)got / 8; /* PFNs past max_pfn read as nothing: count 0 */
        for (k = i; k < j; k++) {
            uint64_t off = pfns[k] - first;
            uint64_t kc = off < avail ? ctx->buf[off] : 0;
            table_find(t, pfns[k])->kpagecount = kc > UINT32_MAX ? UINT32_MAX : (uint32_t)kc;
        }
    }
    free(pfns);
    close(fd);
    return 0;
nomem:
    scan_fail(ctx, SCAN_NOMEM, ENOMEM, 0, path);
error:
    free(pfns);
    if (fd >= 0)
        close(fd);
    return -1;
}

/* Classify the pages; without the GIL.  totals: resident, private, inside, outside. */
static void
classify(scan_ctx *ctx, proc_scan *procs, size_t nprocs, uint64_t totals[4])
{
    pfn_table *t = &ctx->table;
    size_t i, k;

    memset(totals, 0, 4 * sizeof(uint64_t));
    for (i = 0; i <= t->mask; i++) {
        pfn_slot *s = &t->slots[i];
        if (s->pfn == 0 || s->kpagecount == 0)
            continue;
        totals[0]++;
        if (s->kpagecount > s->mapcount)
            totals[3]++;
        else if (s->mapcount == 1)
            totals[1]++;
        else
            totals[2]++;
    }
    for (k = 0; k < nprocs; k++) {
        proc_scan *p = &procs[k];
        for (i = 0; i < p->len; i++) {
            pfn_slot *s = table_find(t, p->pfns[i]);
            if (s->kpagecount == 0)
                continue;
            p->resident++;
            if (s->kpagecount > s->mapcount)
                p->shared_outside++;
            else if (s->nprocs == 1)
                p->private_++;
            else
                p->shared_inside++;
        }
    }
}

static void
raise_scan_error(const scan_error *e)
{
    PyObject *path = PyUnicode_DecodeFSDefault(e->path);
    char detail[96];

    if (path == NULL)
        return;
    switch (e->kind) {
    case SCAN_NOMEM:
        PyErr_NoMemory();
        break;
    case SCAN_VANISHED:
        snprintf(detail, sizeof(detail), "pid %d", (int)e->pid);
        bunshin_set_errno_detail(ESRCH, "scan_pages", detail, path);
        break;
    case SCAN_NO_PFN:
        snprintf(detail, sizeof(detail),
                 "pid %d: page frame numbers read as 0; needs CAP_SYS_ADMIN", (int)e->pid);
        bunshin_set_errno_detail(EPERM, "scan_pages", detail, path);
        break;
    default:
        if (e->pid > 0) {
            snprintf(detail, sizeof(detail), "pid %d", (int)e->pid);
            bunshin_set_errno_detail(e->err, "scan_pages", detail, path);
        }
        else {
            bunshin_set_errno(e->err, "scan_pages", path, NULL);
        }
        break;
    }
    Py_DECREF(path);
}

typedef struct {
    pid_t pid;
    Py_ssize_t pos;
} pid_pos;

static int
cmp_pid_pos(const void *a, const void *b)
{
    const pid_pos *x = a, *y = b;

    if (x->pid != y->pid)
        return (x->pid > y->pid) - (x->pid < y->pid);
    return (x->pos > y->pos) - (x->pos < y->pos);
}

/* ------------------------------------------------------------------------ */
/* The PageScan type and scan_pages().                                      */

static PyStructSequence_Field pagescan_fields[] = {
    {"page_size", "Bytes per page."},
    {"resident", "Unique present physical pages mapped by the set (each PFN once)."},
    {"private", "Pages mapped once, by one process of the set, and by nothing else "
                "(kpagecount == 1)."},
    {"shared_inside", "Pages mapped more than once, every mapping inside the set."},
    {"shared_outside", "Pages also mapped outside the set (kpagecount > mappings in the set)."},
    {"per_pid", "dict pid -> (resident, private, shared_inside, shared_outside) for each "
                "process: private = mapped by that process only, shared_inside = also "
                "mapped by another process of the set and by nothing outside, "
                "shared_outside = mapped outside the set."},
    {NULL, NULL},
};

static PyStructSequence_Desc pagescan_desc = {
    "bunshin_async._bunshin_c.PageScan",
    "Result of scan_pages(): page counts of a set of processes (multiply by\n"
    "page_size for bytes). resident == private + shared_inside + shared_outside.",
    pagescan_fields,
    6,
};

int
bunshin_pagescan_exec(PyObject *module)
{
    bunshin_state *state = bunshin_get_state(module);

    state->PageScanType = PyStructSequence_NewType(&pagescan_desc);
    if (state->PageScanType == NULL)
        return -1;
    return PyModule_AddObjectRef(module, "PageScan", (PyObject *)state->PageScanType);
}

const char bunshin_scan_pages_doc[] =
    "scan_pages(pids)\n--\n\n"
    "Count the physical pages a set of processes maps, exactly, from\n"
    "/proc/PID/pagemap and /proc/kpagecount; return a PageScan. Needs root.";

PyObject *
bunshin_scan_pages(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"pids", NULL};
    bunshin_state *state = bunshin_get_state(module);
    PyObject *pids_obj, *seq = NULL, *result = NULL, *per_pid = NULL, *scan = NULL;
    proc_scan *procs = NULL;
    pid_t *sorted = NULL;
    pid_pos *order = NULL;
    scan_ctx ctx;
    Py_ssize_t n = 0, nprocs = 0, i;
    uint64_t totals[4];
    long page_size = sysconf(_SC_PAGESIZE);
    int rc;

    memset(&ctx, 0, sizeof(ctx));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:scan_pages", kwlist, &pids_obj))
        goto error;
    seq = PySequence_Fast(pids_obj, "scan_pages: pids must be a sequence of ints");
    if (seq == NULL)
        goto error;
    n = PySequence_Fast_GET_SIZE(seq);
    procs = calloc(n ? (size_t)n : 1, sizeof(proc_scan));
    sorted = calloc(n ? (size_t)n : 1, sizeof(pid_t));
    order = calloc(n ? (size_t)n : 1, sizeof(pid_pos));
    if (procs == NULL || sorted == NULL || order == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (i = 0; i < n; i++) {
        long pid = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (pid == -1 && PyErr_Occurred())
            goto error;
        if (pid <= 0 || pid > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "scan_pages: %ld is not a valid pid", pid);
            goto error;
        }
        sorted[i] = (pid_t)pid;
    }
    /* A pid given twice is scanned once (its mappings would count twice):
     * sort (pid, position) pairs and keep the first position of each pid. */
    for (i = 0; i < n; i++)
        order[i] = (pid_pos){sorted[i], i};
    qsort(order, (size_t)n, sizeof(pid_pos), cmp_pid_pos);
    for (i = 0; i < n; i++)
        sorted[i] = (i > 0 && order[i].pid == order[i - 1].pid) ? 0 : 1; /* keep flags */
    for (i = 0; i < n; i++)
        order[i].pid = sorted[i];
    for (i = 0; i < n; i++)
        sorted[order[i].pos] = order[i].pid;
    for (i = 0; i < n; i++) {
        if (sorted[i])
            procs[nprocs++].pid = (pid_t)PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
    }

    ctx.bufcap = KPC_RUN_MAX > PAGEMAP_CHUNK ? KPC_RUN_MAX : PAGEMAP_CHUNK;
    ctx.buf = malloc(ctx.bufcap * sizeof(uint64_t));
    if (ctx.buf == NULL || table_init(&ctx.table, 16) < 0) {
        PyErr_NoMemory();
        goto error;
    }
    ctx.bufcap = PAGEMAP_CHUNK;

    /* One process at a time without the GIL; signal handlers run in between. */
    for (i = 0; i < nprocs; i++) {
        Py_BEGIN_ALLOW_THREADS
        rc = scan_process(&ctx, &procs[i], (int32_t)i, page_size);
        Py_END_ALLOW_THREADS
        if (rc < 0) {
            raise_scan_error(&ctx.error);
            goto error;
        }
        if (PyErr_CheckSignals() < 0)
            goto error;
    }
    Py_BEGIN_ALLOW_THREADS
    ctx.bufcap = KPC_RUN_MAX;
    rc = read_kpagecounts(&ctx);
    if (rc == 0)
        classify(&ctx, procs, (size_t)nprocs, totals);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        raise_scan_error(&ctx.error);
        goto error;
    }

    per_pid = PyDict_New();
    if (per_pid == NULL)
        goto error;
    for (i = 0; i < nprocs; i++) {
        proc_scan *p = &procs[i];
        PyObject *key = PyLong_FromLong(p->pid), *value;
        if (key == NULL)
            goto error;
        value = Py_BuildValue("(KKKK)", (unsigned long long)p->resident,
                              (unsigned long long)p->private_,
                              (unsigned long long)p->shared_inside,
                              (unsigned long long)p->shared_outside);
        if (value == NULL || PyDict_SetItem(per_pid, key, value) < 0) {
            Py_DECREF(key);
            Py_XDECREF(value);
            goto error;
        }
        Py_DECREF(key);
        Py_DECREF(value);
    }
    scan = PyStructSequence_New(state->PageScanType);
    if (scan == NULL)
        goto error;
    PyStructSequence_SET_ITEM(scan, 0, PyLong_FromLong(page_size));
    for (i = 0; i < 4; i++)
        PyStructSequence_SET_ITEM(scan, i + 1, PyLong_FromUnsignedLongLong(totals[i]));
    PyStructSequence_SET_ITEM(scan, 5, Py_NewRef(per_pid));
    for (i = 0; i < 6; i++) {
        if (PyStructSequence_GET_ITEM(scan, i) == NULL)
            goto error;
    }
    result = Py_NewRef(scan);
error:
    Py_XDECREF(scan);
    Py_XDECREF(per_pid);
    if (procs != NULL) {
        for (i = 0; i < nprocs; i++)
            free(procs[i].pfns);
    }
    free(procs);
    free(sorted);
    free(order);
    free(ctx.table.slots);
    free(ctx.buf);
    free(ctx.maps);
    Py_XDECREF(seq);
    return result;
}
