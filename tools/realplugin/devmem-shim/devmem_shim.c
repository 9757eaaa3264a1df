// tcpxd devmem shim: the TCPX-era devmem-tcp interface that Google's TCPX plugin uses on its CUDA
// path, emulated over ordinary TCP in user space (LD_PRELOAD into the process that loads the
// plugin). Written from the plugin's use of the interface (docs/CONFORMANCE.md, "The kernel
// interfaces of the plugin's CUDA path"); no code of the plugin's is here.
//
// Receive: recvmsg(fd, msg, MSG_SOCK_DEVMEM) on a socket whose flow RxDM steered to a GPU (a rule
// the fake RxDM in `a3vm` mode filed under the NIC serving that GPU, matching the flow's
// 5-tuple, and that NIC is the one the flow arrives on) reads the bytes into free 4 KiB pages of
// that GPU's receive pool (the file the fake RxDM hands the plugin as `get_gpu_fd_<pci>`) and
// returns one SCM_DEVMEM_OFFSET control message per page, {frag_offset, frag_size, frag_token};
// no user bytes. A flow no rule steers gets its bytes in the user buffer and no control message,
// as on A3 (the plugin then exits: "no cmsg"). setsockopt(SO_DEVMEM_DONTNEED) returns pages.
//
// Send: ioctl(dma_buf_fd, DMA_BUF_CREATE_PAGES) on a dma-buf the CUDA stand-in exported
// (cuMemGetHandleForAddressRange) returns a "pages" fd; sendmsg with an SCM_DEVMEM_OFFSET
// control message {pages fd, offset} sends that many bytes of the dma-buf from `offset` (not the
// iovec's bytes), with the caller's flags (MSG_ZEROCOPY completions come from the kernel).
//
// Also: realpath("/sys/class/net/<nic>/device") of a NIC without a PCI device (a veth) answers a
// made-up PCI path, since the plugin's regMr of CUDA memory takes the NIC's PCI address from it.
//
// Environment:
//   TCPXD_DEVMEM_DIR        the fake RxDM's folder (its `devmem-rules` and `gpumem-<pci>` files);
//                           default NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX
//   TCPXD_DEVMEM_NIC_PCI    NIC=PCI,... for realpath (default eth1..eth4 = 0000:06/0c/86/8c:00.0)
//   TCPXD_DEVMEM_LOG        1: a line per recycled batch and per send too (default: a line per flow)
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MSG_SOCK_DEVMEM 0x2000000
#define SO_DEVMEM_DONTNEED 97
#define SCM_DEVMEM_HEADER 98
#define SCM_DEVMEM_OFFSET 99
#define PAGE 4096u
#define MAX_POOLS 16
#define MAX_FDS 65536
#define MAX_RULES 4096
#define MAX_NICS 16
#define MAX_PAGES_FDS 1024
#define MAX_FRAGS 1024 /* NCCL's NET_UNPACK_MAX_SLICE_PAGES: 4 MiB of 4 KiB pages */

struct devmemvec {
  uint32_t frag_offset, frag_size, frag_token;
};
struct devmemtoken {
  uint32_t token_start, token_count;
};
struct dma_buf_create_pages_info {
  uint64_t pci_bdf[3];
  int32_t dma_buf_fd;
  int32_t create_page_pool;
};
#define DMA_BUF_CREATE_PAGES _IOW('b', 2, struct dma_buf_create_pages_info)

typedef ssize_t (*recvmsg_fn)(int, struct msghdr *, int);
typedef ssize_t (*sendmsg_fn)(int, const struct msghdr *, int);
typedef int (*setsockopt_fn)(int, int, int, const void *, socklen_t);
typedef int (*ioctl_fn)(int, unsigned long, ...);
typedef char *(*realpath_fn)(const char *, char *);
typedef int (*close_fn)(int);
typedef int (*range_fn)(int, uint64_t *, uint64_t *, int *);

static recvmsg_fn real_recvmsg;
static sendmsg_fn real_sendmsg;
static setsockopt_fn real_setsockopt;
static ioctl_fn real_ioctl;
static realpath_fn real_realpath;
static close_fn real_close;

struct pool {
  char gpu[64];
  uint8_t *base;
  uint32_t pages;
  uint16_t *ref;   /* per page: frags handed out and not yet returned */
  int32_t *owner;  /* per page: the fd of the socket it was handed to (-1: free) */
  uint32_t hint, used, peak;
  uint64_t landed;
};
struct rule {
  char nic[64], gpu[64], src[INET6_ADDRSTRLEN], dst[INET6_ADDRSTRLEN];
  int src_port, dst_port;
};
struct nic {
  char name[64], addr[INET6_ADDRSTRLEN];
};
struct flow {
  ino_t ino; /* 0: not classified */
  int pool;  /* -1: no rule steers it */
  char nic[64];
  uint64_t bytes;
  /* Since when (CLOCK_MONOTONIC ns) fewer bytes than a page are waiting, and how many. */
  uint64_t short_since;
  int short_avail;
};
struct pages_fd {
  int fd;
  ino_t ino;
  uint8_t *map;
  uint64_t len;
  int device;
  uint64_t sent;
};

static pthread_mutex_t lock_ = PTHREAD_MUTEX_INITIALIZER;
/* Set while this thread holds the lock: a close() from inside (fclose) must not take it again. */
static __thread int holding;
static void lock_shim(void) {
  pthread_mutex_lock(&lock_);
  holding = 1;
}
static void unlock_shim(void) {
  holding = 0;
  pthread_mutex_unlock(&lock_);
}
static char dir[PATH_MAX];
static struct pool pools[MAX_POOLS];
static int npools;
static struct rule rules[MAX_RULES];
static int nrules;
static struct nic nics[MAX_NICS];
static int nnics;
static struct timespec rules_mtime;
static struct flow flows[MAX_FDS];
static struct pages_fd pfds[MAX_PAGES_FDS];
static int verbose;
static uint64_t no_cmsg_bytes;
static uint64_t short_receives; /* receives that took less than a page to unblock a flow */

static void say(const char *fmt, ...) {
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (n > (int)sizeof line - 2) n = sizeof line - 2;
  line[n++] = '\n';
  ssize_t w = write(2, line, n);
  (void)w;
}

__attribute__((constructor)) static void shim_init(void) {
  real_recvmsg = (recvmsg_fn)dlsym(RTLD_NEXT, "recvmsg");
  real_sendmsg = (sendmsg_fn)dlsym(RTLD_NEXT, "sendmsg");
  real_setsockopt = (setsockopt_fn)dlsym(RTLD_NEXT, "setsockopt");
  real_ioctl = (ioctl_fn)dlsym(RTLD_NEXT, "ioctl");
  real_realpath = (realpath_fn)dlsym(RTLD_NEXT, "realpath");
  real_close = (close_fn)dlsym(RTLD_NEXT, "close");
  const char *d = getenv("TCPXD_DEVMEM_DIR");
  if (!d || !*d) d = getenv("NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX");
  if (d) snprintf(dir, sizeof dir, "%s", d);
  const char *v = getenv("TCPXD_DEVMEM_LOG");
  verbose = v && *v == '1';
  for (int i = 0; i < MAX_PAGES_FDS; i++) pfds[i].fd = -1;
}

/* ---- the fake RxDM's shared state: `nic NAME ADDR` and `rule NIC GPU SRC SPORT DST DPORT` ---- */

static void normalise_ip(const char *in, char *out) {
  unsigned char b[16];
  if (inet_pton(AF_INET, in, b) == 1) {
    inet_ntop(AF_INET, b, out, INET6_ADDRSTRLEN);
  } else if (inet_pton(AF_INET6, in, b) == 1) {
    if (IN6_IS_ADDR_V4MAPPED((struct in6_addr *)b))
      inet_ntop(AF_INET, b + 12, out, INET6_ADDRSTRLEN);
    else
      inet_ntop(AF_INET6, b, out, INET6_ADDRSTRLEN);
  } else {
    snprintf(out, INET6_ADDRSTRLEN, "%s", in);
  }
}

/* Re-reads the rules file when it changed. Called with the lock held. */
static void load_rules(void) {
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/devmem-rules", dir);
  struct stat st;
  if (stat(path, &st) != 0) {
    nrules = 0;
    nnics = 0;
    return;
  }
  if (st.st_mtim.tv_sec == rules_mtime.tv_sec && st.st_mtim.tv_nsec == rules_mtime.tv_nsec) return;
  FILE *f = fopen(path, "r");
  if (!f) return;
  rules_mtime = st.st_mtim;
  nrules = 0;
  nnics = 0;
  char line[512], a[64], b[64], c[64], d[64], e[64], g[64], h[64];
  while (fgets(line, sizeof line, f)) {
    int n = sscanf(line, "%63s %63s %63s %63s %63s %63s %63s", a, b, c, d, e, g, h);
    if (n == 3 && strcmp(a, "nic") == 0 && nnics < MAX_NICS) {
      snprintf(nics[nnics].name, sizeof nics[nnics].name, "%s", b);
      normalise_ip(c, nics[nnics].addr);
      nnics++;
    } else if (n == 7 && strcmp(a, "rule") == 0 && nrules < MAX_RULES) {
      struct rule *r = &rules[nrules++];
      snprintf(r->nic, sizeof r->nic, "%s", b);
      snprintf(r->gpu, sizeof r->gpu, "%s", c);
      normalise_ip(d, r->src);
      r->src_port = atoi(e);
      normalise_ip(g, r->dst);
      r->dst_port = atoi(h);
    }
  }
  fclose(f);
}

static int sockaddr_text(const struct sockaddr_storage *ss, char *ip, int *port) {
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *s = (const struct sockaddr_in *)ss;
    inet_ntop(AF_INET, &s->sin_addr, ip, INET6_ADDRSTRLEN);
    *port = ntohs(s->sin_port);
    return 0;
  }
  if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)ss;
    char tmp[INET6_ADDRSTRLEN];
    inet_ntop(AF_INET6, &s->sin6_addr, tmp, sizeof tmp);
    normalise_ip(tmp, ip);
    *port = ntohs(s->sin6_port);
    return 0;
  }
  return -1;
}

/* The pool of `gpu`, opened on first use. Called with the lock held. */
static int pool_of(const char *gpu) {
  for (int i = 0; i < npools; i++)
    if (strcasecmp(pools[i].gpu, gpu) == 0) return i;
  if (npools == MAX_POOLS) return -1;
  char path[PATH_MAX + 128];
  snprintf(path, sizeof path, "%s/gpumem-%s", dir, gpu);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    say("devmem-shim: %s: %s (the fake RxDM's GPU receive memory; start it with --gpu-nic-preset a3vm)", path,
        strerror(errno));
    return -1;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < (off_t)PAGE) {
    real_close(fd);
    return -1;
  }
  void *m = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  real_close(fd);
  if (m == MAP_FAILED) return -1;
  struct pool *p = &pools[npools];
  snprintf(p->gpu, sizeof p->gpu, "%s", gpu);
  p->base = m;
  p->pages = st.st_size / PAGE;
  p->ref = calloc(p->pages, sizeof *p->ref);
  p->owner = malloc(p->pages * sizeof *p->owner);
  if (!p->ref || !p->owner) {
    munmap(m, st.st_size);
    free(p->ref);
    free(p->owner);
    return -1;
  }
  for (uint32_t i = 0; i < p->pages; i++) p->owner[i] = -1;
  return npools++;
}

/* Classifies socket `fd` (cached per fd and inode). Called with the lock held. Returns the flow or
 * NULL (not a socket the shim can track). */
static struct flow *classify(int fd) {
  if (fd < 0 || fd >= MAX_FDS) return NULL;
  struct stat st;
  if (fstat(fd, &st) != 0) return NULL;
  struct flow *fl = &flows[fd];
  if (fl->ino == st.st_ino) return fl;
  memset(fl, 0, sizeof *fl);
  fl->ino = st.st_ino;
  fl->pool = -1;
  snprintf(fl->nic, sizeof fl->nic, "?");
  struct sockaddr_storage l, r;
  socklen_t ll = sizeof l, rl = sizeof r;
  char lip[INET6_ADDRSTRLEN] = "?", rip[INET6_ADDRSTRLEN] = "?";
  int lport = 0, rport = 0;
  if (getsockname(fd, (struct sockaddr *)&l, &ll) != 0 || getpeername(fd, (struct sockaddr *)&r, &rl) != 0 ||
      sockaddr_text(&l, lip, &lport) != 0 || sockaddr_text(&r, rip, &rport) != 0) {
    say("devmem-shim: fd %d: not a connected TCP socket: no devmem", fd);
    return fl;
  }
  load_rules();
  /* The NIC the flow arrives on: the one owning its destination (our local) address. */
  for (int i = 0; i < nnics; i++)
    if (strcmp(nics[i].addr, lip) == 0) snprintf(fl->nic, sizeof fl->nic, "%s", nics[i].name);
  const struct rule *hit = NULL, *elsewhere = NULL;
  for (int i = 0; i < nrules; i++) {
    const struct rule *ru = &rules[i];
    if (strcmp(ru->src, rip) || ru->src_port != rport || strcmp(ru->dst, lip) || ru->dst_port != lport) continue;
    if (strcmp(ru->nic, fl->nic) == 0)
      hit = ru;
    else
      elsewhere = ru;
  }
  if (hit) {
    fl->pool = pool_of(hit->gpu);
    say("devmem-shim: flow %s:%d -> %s:%d arrives on %s: steered to GPU %s's receive memory%s", rip, rport, lip,
        lport, fl->nic, hit->gpu, fl->pool < 0 ? " (which cannot be opened: no devmem)" : "");
  } else if (elsewhere) {
    say("devmem-shim: flow %s:%d -> %s:%d arrives on %s, but its rule (GPU %s) was filed under %s: it lands in "
        "host memory, no devmem cmsg",
        rip, rport, lip, lport, fl->nic, elsewhere->gpu, elsewhere->nic);
  } else {
    say("devmem-shim: flow %s:%d -> %s:%d arrives on %s: no flow-steering rule: it lands in host memory, no devmem "
        "cmsg",
        rip, rport, lip, lport, fl->nic);
  }
  return fl;
}

/* Writes `devmem-stats.<pid>` beside the rules: per pool bytes landed and pages in use, per
 * dma-buf bytes sent, bytes without devmem, short receives. Called with
 * `lock` held. */
static void write_stats(void) {
  if (!*dir) return;
  char path[PATH_MAX + 64], tmp[PATH_MAX + 80];
  snprintf(path, sizeof path, "%s/devmem-stats.%d", dir, (int)getpid());
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) return;
  for (int i = 0; i < npools; i++)
    fprintf(f, "pool %s landed %llu pages_in_use %u peak %u of %u\n", pools[i].gpu,
            (unsigned long long)pools[i].landed, pools[i].used, pools[i].peak, pools[i].pages);
  for (int i = 0; i < MAX_PAGES_FDS; i++)
    if (pfds[i].fd >= 0 && pfds[i].sent) fprintf(f, "dmabuf device %d sent %llu\n", pfds[i].device, (unsigned long long)pfds[i].sent);
  fprintf(f, "no_cmsg_bytes %llu short_receives %llu\n", (unsigned long long)no_cmsg_bytes,
          (unsigned long long)short_receives);
  fclose(f);
  rename(tmp, path);
}

__attribute__((destructor)) static void shim_fini(void) {
  lock_shim();
  write_stats();
  unlock_shim();
}

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + t.tv_nsec;
}

/* How long fewer than a page's bytes may wait for more before they are taken as they are. */
#define SHORT_WAIT_NS 2000000u

static void maybe_write_stats(void) {
  static time_t last;
  time_t now = time(NULL);
  if (now != last) {
    last = now;
    write_stats();
  }
}

/* ---- receive ---- */

static ssize_t devmem_recv(int fd, struct msghdr *msg, int flags) {
  flags &= ~MSG_SOCK_DEVMEM;
  lock_shim();
  struct flow *fl = classify(fd);
  int pi = fl ? fl->pool : -1;
  unlock_shim();
  if (pi < 0) {
    /* Not steered: the bytes land in host memory (the user buffer), no devmem cmsg. */
    msg->msg_controllen = 0;
    ssize_t n = real_recvmsg(fd, msg, flags);
    if (n > 0) {
      lock_shim();
      no_cmsg_bytes += n;
      maybe_write_stats();
      unlock_shim();
    }
    return n;
  }
  size_t want = 0;
  for (size_t i = 0; i < msg->msg_iovlen; i++) want += msg->msg_iov[i].iov_len;
  if (want == 0) {
    msg->msg_controllen = 0;
    return 0;
  }
  size_t cap = msg->msg_controllen / CMSG_SPACE(sizeof(struct devmemvec));
  if (cap > MAX_FRAGS) cap = MAX_FRAGS;
  if (cap == 0) {
    errno = EINVAL;
    return -1;
  }
  int avail = 0;
  if (real_ioctl(fd, FIONREAD, &avail) != 0) return -1;
  size_t n;
  if ((size_t)avail >= want) {
    n = want;
  } else {
    /* Whole pages, unless the rest of what the caller wants is there: the page pool hands out
     * whole pages and the plugin's fragment budget per receive (1024) assumes them. */
    n = (size_t)avail / PAGE * PAGE;
  }
  if (n == 0 && avail > 0) {
    /* Less than a page waits. More usually follows at once; but a receive queue whose memory
     * is full (small skbs of large truesize) closes the window and nothing more comes until
     * these bytes are read: after SHORT_WAIT_NS with no more, take them as they are. */
    uint64_t now = now_ns();
    lock_shim();
    if (fl->short_since == 0 || fl->short_avail != avail) {
      fl->short_since = now;
      fl->short_avail = avail;
    } else if (now - fl->short_since >= SHORT_WAIT_NS) {
      n = (size_t)avail;
      short_receives++;
    }
    unlock_shim();
    if (n == 0) {
      errno = EAGAIN;
      return -1;
    }
  }
  if (n == 0) {
    char b;
    ssize_t r = recv(fd, &b, 1, MSG_PEEK | (flags & MSG_DONTWAIT));
    if (r <= 0) {
      msg->msg_controllen = 0;
      return r; /* 0: the peer closed; -1: errno from the socket */
    }
    /* Data arrived meanwhile: let the caller come back. */
    errno = EAGAIN;
    return -1;
  }
  fl->short_since = 0;
  size_t pages = (n + PAGE - 1) / PAGE;
  if (pages > cap) {
    pages = cap;
    n = pages * PAGE;
  }
  uint32_t idx[MAX_FRAGS];
  size_t got = 0;
  lock_shim();
  struct pool *p = &pools[pi];
  for (uint32_t k = 0; k < p->pages && got < pages; k++) {
    uint32_t at = (p->hint + k) % p->pages;
    if (p->ref[at] == 0) {
      p->ref[at] = 1;
      p->owner[at] = fd;
      idx[got++] = at;
    }
  }
  if (got) p->hint = (idx[got - 1] + 1) % p->pages;
  p->used += got;
  if (p->used > p->peak) p->peak = p->used;
  unlock_shim();
  if (got == 0) {
    /* The pool is exhausted until the plugin returns pages (the NIC would drop: retry later). */
    errno = EAGAIN;
    return -1;
  }
  if (got < pages) {
    pages = got;
    if (n > pages * PAGE) n = pages * PAGE;
  }
  struct iovec iov[MAX_FRAGS];
  size_t left = n;
  for (size_t i = 0; i < pages; i++) {
    iov[i].iov_base = p->base + (size_t)idx[i] * PAGE;
    iov[i].iov_len = left < PAGE ? left : PAGE;
    left -= iov[i].iov_len;
  }
  struct msghdr m;
  memset(&m, 0, sizeof m);
  m.msg_iov = iov;
  m.msg_iovlen = pages;
  ssize_t r = real_recvmsg(fd, &m, flags);
  size_t used_pages = r > 0 ? ((size_t)r + PAGE - 1) / PAGE : 0;
  lock_shim();
  for (size_t i = used_pages; i < pages; i++) {
    p->ref[idx[i]] = 0;
    p->owner[idx[i]] = -1;
  }
  p->used -= pages - used_pages;
  if (r > 0) {
    p->landed += r;
    fl->bytes += r;
  }
  maybe_write_stats();
  unlock_shim();
  if (r <= 0) {
    msg->msg_controllen = 0;
    return r;
  }
  struct cmsghdr *cm = CMSG_FIRSTHDR(msg);
  size_t off = 0;
  for (size_t i = 0; i < used_pages; i++) {
    struct devmemvec v = {idx[i] * PAGE, (uint32_t)((size_t)r - off < PAGE ? (size_t)r - off : PAGE), idx[i]};
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_DEVMEM_OFFSET;
    cm->cmsg_len = CMSG_LEN(sizeof v);
    memcpy(CMSG_DATA(cm), &v, sizeof v);
    off += v.frag_size;
    cm = (struct cmsghdr *)((char *)cm + CMSG_SPACE(sizeof v));
  }
  msg->msg_controllen = used_pages * CMSG_SPACE(sizeof(struct devmemvec));
  msg->msg_flags = 0;
  return r;
}

ssize_t recvmsg(int fd, struct msghdr *msg, int flags) {
  if (!real_recvmsg) shim_init();
  if (!(flags & MSG_SOCK_DEVMEM) || !msg) return real_recvmsg(fd, msg, flags);
  return devmem_recv(fd, msg, flags);
}

static int dontneed(int fd, const struct devmemtoken *t, size_t count) {
  lock_shim();
  struct flow *fl = (fd >= 0 && fd < MAX_FDS) ? &flows[fd] : NULL;
  int pi = fl && fl->ino ? fl->pool : -1;
  if (pi < 0) {
    unlock_shim();
    errno = EINVAL;
    return -1;
  }
  struct pool *p = &pools[pi];
  size_t freed = 0, bad = 0;
  for (size_t i = 0; i < count; i++)
    for (uint32_t k = 0; k < t[i].token_count; k++) {
      uint32_t tok = t[i].token_start + k;
      if (tok < p->pages && p->ref[tok] > 0 && p->owner[tok] == fd) {
        if (--p->ref[tok] == 0) {
          p->owner[tok] = -1;
          p->used--;
          freed++;
        }
      } else {
        bad++;
      }
    }
  unlock_shim();
  if (verbose) say("devmem-shim: fd %d returned %zu pages of GPU %s", fd, freed, p->gpu);
  if (bad) {
    say("devmem-shim: fd %d returned %zu tokens it does not hold (GPU %s)", fd, bad, p->gpu);
    errno = EINVAL;
    return -1;
  }
  return 0;
}

int setsockopt(int fd, int level, int name, const void *val, socklen_t len) {
  if (!real_setsockopt) shim_init();
  if (level == SOL_SOCKET && name == SO_DEVMEM_DONTNEED) {
    if (!val || len % sizeof(struct devmemtoken)) {
      errno = EINVAL;
      return -1;
    }
    return dontneed(fd, val, len / sizeof(struct devmemtoken));
  }
  return real_setsockopt(fd, level, name, val, len);
}

/* ---- send ---- */

static range_fn stub_range(void) {
  static range_fn f;
  if (!f) f = (range_fn)dlsym(RTLD_DEFAULT, "tcpxd_cudastub_dmabuf_range");
  if (!f) {
    /* The plugin's libcuda.so.1 is loaded in its own (local) scope: ask that library. */
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h) f = (range_fn)dlsym(h, "tcpxd_cudastub_dmabuf_range");
  }
  return f;
}

static int create_pages(int dmabuf, struct dma_buf_create_pages_info *info) {
  range_fn range = stub_range();
  uint64_t off = 0, len = 0;
  int device = -1;
  if (!range || range(dmabuf, &off, &len, &device) != 0) {
    errno = ENOTTY; /* not a dma-buf */
    return -1;
  }
  uint64_t start = off / PAGE * PAGE;
  void *m = mmap(NULL, len + (off - start), PROT_READ, MAP_SHARED, dmabuf, start);
  if (m == MAP_FAILED) return -1;
  int fd = fcntl(dmabuf, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    munmap(m, len + (off - start));
    return -1;
  }
  struct stat st;
  fstat(fd, &st);
  lock_shim();
  struct pages_fd *slot = NULL;
  for (int i = 0; i < MAX_PAGES_FDS && !slot; i++)
    if (pfds[i].fd == fd) slot = &pfds[i];
  for (int i = 0; i < MAX_PAGES_FDS && !slot; i++)
    if (pfds[i].fd < 0) slot = &pfds[i];
  if (!slot) {
    unlock_shim();
    munmap(m, len + (off - start));
    real_close(fd);
    errno = ENOMEM;
    return -1;
  }
  if (slot->fd == fd && slot->map) munmap(slot->map, slot->len); /* a stale entry of a closed fd */
  slot->fd = fd;
  slot->ino = st.st_ino;
  slot->map = (uint8_t *)m + (off - start);
  slot->len = len;
  slot->device = device;
  slot->sent = 0;
  unlock_shim();
  if (verbose)
    say("devmem-shim: dma-buf of GPU %d (%llu bytes) for NIC %04llx:%02llx.%llx: pages fd %d", device,
        (unsigned long long)len, (unsigned long long)info->pci_bdf[0], (unsigned long long)info->pci_bdf[1],
        (unsigned long long)info->pci_bdf[2], fd);
  return fd;
}

int ioctl(int fd, unsigned long request, ...) {
  va_list ap;
  va_start(ap, request);
  void *arg = va_arg(ap, void *);
  va_end(ap);
  if (!real_ioctl) shim_init();
  if (request == DMA_BUF_CREATE_PAGES && arg) return create_pages(fd, arg);
  return real_ioctl(fd, request, arg);
}

static ssize_t devmem_send(int fd, const struct msghdr *msg, int flags, int pfd, uint32_t off) {
  size_t want = 0;
  for (size_t i = 0; i < msg->msg_iovlen; i++) want += msg->msg_iov[i].iov_len;
  lock_shim();
  struct pages_fd *pf = NULL;
  for (int i = 0; i < MAX_PAGES_FDS; i++)
    if (pfds[i].fd == pfd) pf = &pfds[i];
  struct stat st;
  if (!pf || fstat(pfd, &st) != 0 || st.st_ino != pf->ino || (uint64_t)off + want > pf->len) {
    unlock_shim();
    errno = pf ? EFAULT : EBADF;
    return -1;
  }
  struct iovec iov = {pf->map + off, want};
  unlock_shim();
  struct msghdr m;
  memset(&m, 0, sizeof m);
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  ssize_t r = real_sendmsg(fd, &m, flags);
  if (r > 0) {
    lock_shim();
    pf->sent += r;
    maybe_write_stats();
    unlock_shim();
  }
  return r;
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags) {
  if (!real_sendmsg) shim_init();
  if (msg && msg->msg_control && msg->msg_controllen >= CMSG_LEN(2 * sizeof(int))) {
    struct cmsghdr *cm = CMSG_FIRSTHDR(msg);
    if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_DEVMEM_OFFSET &&
        cm->cmsg_len >= CMSG_LEN(2 * sizeof(int))) {
      int v[2];
      memcpy(v, CMSG_DATA(cm), sizeof v);
      return devmem_send(fd, msg, flags, v[0], (uint32_t)v[1]);
    }
  }
  return real_sendmsg(fd, msg, flags);
}

/* A socket's pages go back to the pool when it closes, as the kernel frees a socket's
 * outstanding tokens. */
int close(int fd) {
  if (!real_close) shim_init();
  if (fd >= 0 && fd < MAX_FDS && !holding) {
    lock_shim();
    struct flow *fl = &flows[fd];
    if (fl->ino && fl->pool >= 0) {
      struct pool *p = &pools[fl->pool];
      for (uint32_t i = 0; i < p->pages; i++)
        if (p->owner[i] == fd) {
          p->ref[i] = 0;
          p->owner[i] = -1;
          p->used--;
        }
    }
    if (fl->ino) memset(fl, 0, sizeof *fl);
    unlock_shim();
  }
  return real_close(fd);
}

/* ---- the NICs' PCI paths ---- */

static int nic_pci(const char *nic, char *out, size_t outlen) {
  const char *map = getenv("TCPXD_DEVMEM_NIC_PCI");
  if (!map || !*map) map = "eth1=0000:06:00.0,eth2=0000:0c:00.0,eth3=0000:86:00.0,eth4=0000:8c:00.0";
  size_t nl = strlen(nic);
  for (const char *p = map; *p;) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len > nl + 1 && strncmp(p, nic, nl) == 0 && p[nl] == '=') {
      snprintf(out, outlen, "%.*s", (int)(len - nl - 1), p + nl + 1);
      return 0;
    }
    if (!end) break;
    p = end + 1;
  }
  return -1;
}

char *realpath(const char *path, char *resolved) {
  if (!real_realpath) shim_init();
  char *r = real_realpath(path, resolved);
  if (r || !path) return r;
  const char *pre = "/sys/class/net/";
  size_t pl = strlen(pre);
  if (strncmp(path, pre, pl) != 0) return r;
  const char *nic = path + pl;
  const char *slash = strchr(nic, '/');
  if (!slash || strcmp(slash, "/device") != 0) return r;
  char name[64], pci[64];
  snprintf(name, sizeof name, "%.*s", (int)(slash - nic), nic);
  if (nic_pci(name, pci, sizeof pci) != 0) return r;
  char fake[PATH_MAX];
  snprintf(fake, sizeof fake, "/sys/devices/pci0000:00/%s", pci);
  char *out = resolved ? resolved : malloc(PATH_MAX);
  if (!out) return NULL;
  snprintf(out, PATH_MAX, "%s", fake);
  errno = 0;
  return out;
}
