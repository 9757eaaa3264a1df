/* The variadic ncclDebugLogger_t the plugin calls. Stable Rust cannot define a C-variadic function,
 * so this shim formats the message with vsnprintf and hands the finished string to Rust. A line
 * nobody reads (a trace line while `tcpxd::plugin` traces are off: the emulation logs two per
 * request, posted and done) is counted and dropped before it is formatted. */
#include <stdarg.h>
#include <stdio.h>

extern int tcpxd_plugin_log_skip(int level);
extern void tcpxd_plugin_log_sink(int level, unsigned long flags, const char *file, int line,
                                  const char *msg);

void tcpxd_plugin_logger(int level, unsigned long flags, const char *file, int line,
                         const char *fmt, ...) {
  char buf[2048];
  va_list ap;
  if (tcpxd_plugin_log_skip(level)) {
    return;
  }
  if (fmt == NULL) {
    buf[0] = '\0';
  } else {
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
  }
  tcpxd_plugin_log_sink(level, flags, file, line, buf);
}
