#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

/* railyard lab: report the memlock limit a container was given (RAILYARD_LAB_MEMLOCK)
   where this sandbox may not raise it for real (no CAP_SYS_RESOURCE). */
static int fake(int resource, struct rlimit *r) {
    const char *v = getenv("RAILYARD_LAB_MEMLOCK");
    if (resource != RLIMIT_MEMLOCK || !v || !r) return 0;
    rlim_t n = strcmp(v, "unlimited") == 0 ? RLIM_INFINITY : (rlim_t)strtoull(v, 0, 10);
    r->rlim_cur = n; r->rlim_max = n;
    return 1;
}
int getrlimit(__rlimit_resource_t resource, struct rlimit *r) {
    static int (*real)(__rlimit_resource_t, struct rlimit *);
    if (!real) real = dlsym(RTLD_NEXT, "getrlimit");
    int rc = real(resource, r);
    if (rc == 0) fake(resource, r);
    return rc;
}
int getrlimit64(__rlimit_resource_t resource, struct rlimit64 *r) {
    static int (*real)(__rlimit_resource_t, struct rlimit64 *);
    if (!real) real = dlsym(RTLD_NEXT, "getrlimit64");
    int rc = real(resource, r);
    if (rc == 0) fake(resource, (struct rlimit *)r);
    return rc;
}
int prlimit64(pid_t pid, __rlimit_resource_t resource, const struct rlimit64 *n, struct rlimit64 *o) {
    static int (*real)(pid_t, __rlimit_resource_t, const struct rlimit64 *, struct rlimit64 *);
    if (!real) real = dlsym(RTLD_NEXT, "prlimit64");
    int rc = real(pid, resource, n, o);
    if (rc == 0 && o && (pid == 0)) fake(resource, (struct rlimit *)o);
    return rc;
}
