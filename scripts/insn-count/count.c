/*
 * A qemu-user TCG plugin that counts the guest instructions a run executes
 * and prints the total when the program exits (QEMU's plugin log: `-d
 * plugin`, on stderr): the one measure of
 * a kernel's work that emulation gives (its timings say nothing about a
 * real core). Written against QEMU's plugin interface version 1 (QEMU 7.2,
 * Debian 12's qemu-user), declared here so that no QEMU headers are needed.
 *
 * The counter is added to once per executed translation block, by the
 * block's instruction count; it is not atomic, so count runs whose work
 * happens on one thread (`--threads 1`, `-t 1`).
 *
 *   gcc -shared -fPIC -O2 -o count.so count.c
 *   qemu-aarch64 -d plugin -plugin ./count.so -cpu max ./program
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define EXPORT __attribute__((visibility("default")))

typedef uint64_t plugin_id;
struct qemu_plugin_tb;
struct qemu_info_t;

/* QEMU's plugin interface, version 1. */
EXPORT int qemu_plugin_version = 1;
enum inline_op { INLINE_ADD_U64 = 0 };
void qemu_plugin_register_vcpu_tb_trans_cb(plugin_id id,
                                           void (*cb)(plugin_id, struct qemu_plugin_tb *));
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum inline_op op,
                                              void *ptr, uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_atexit_cb(plugin_id id, void (*cb)(plugin_id, void *), void *data);
void qemu_plugin_outs(const char *text);

static uint64_t executed;

static void on_translation(plugin_id id, struct qemu_plugin_tb *tb)
{
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_inline(tb, INLINE_ADD_U64, &executed,
                                             qemu_plugin_tb_n_insns(tb));
}

static void on_program_exit(plugin_id id, void *data)
{
    char line[64];
    (void)id;
    (void)data;
    snprintf(line, sizeof line, "guest instructions: %" PRIu64 "\n", executed);
    qemu_plugin_outs(line);
}

EXPORT int qemu_plugin_install(plugin_id id, const struct qemu_info_t *info, int argc,
                               char **argv)
{
    (void)info;
    (void)argc;
    (void)argv;
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translation);
    qemu_plugin_register_atexit_cb(id, on_program_exit, NULL);
    return 0;
}
