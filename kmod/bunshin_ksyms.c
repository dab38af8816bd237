// SPDX-License-Identifier: GPL-2.0
/*
 * bunshin_ksyms.c: find the unexported kernel functions the fork command
 * needs.
 *
 * kallsyms_lookup_name() is not exported since 5.7, but a kprobe placed on it
 * reports its address. With CONFIG_X86_KERNEL_IBT the kprobe may sit just past
 * the function's ENDBR64 instruction: an indirect call must land on the ENDBR,
 * so the address is moved back onto it.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/kernel.h>
#include <linux/kprobes.h>
#include <linux/spinlock.h>
#include <linux/string.h>

#include "bunshin_internal.h"

struct bunshin_ksyms bunshin_ksyms;

typedef unsigned long (*bunshin_lookup_fn)(const char *name);

#ifdef CONFIG_X86_64
static const u8 bunshin_endbr64[] = { 0xf3, 0x0f, 0x1e, 0xfa };

static unsigned long bunshin_fix_endbr(unsigned long addr)
{
	u8 before[sizeof(bunshin_endbr64)], at[sizeof(bunshin_endbr64)];
	unsigned long prev = addr - sizeof(bunshin_endbr64);

	if (copy_from_kernel_nofault(at, (void *)addr, sizeof(at)) ||
	    !memcmp(at, bunshin_endbr64, sizeof(at)))
		return addr;
	if (!copy_from_kernel_nofault(before, (void *)prev, sizeof(before)) &&
	    !memcmp(before, bunshin_endbr64, sizeof(before)))
		return prev;
	return addr;
}
#else
static unsigned long bunshin_fix_endbr(unsigned long addr)
{
	return addr;
}
#endif

static bunshin_lookup_fn bunshin_find_lookup(void)
{
	struct kprobe kp = { .symbol_name = "kallsyms_lookup_name" };
	unsigned long addr;
	int ret;

	ret = register_kprobe(&kp);
	if (ret < 0) {
		pr_warn("cannot place a kprobe on kallsyms_lookup_name: %d\n",
			ret);
		return NULL;
	}
	addr = (unsigned long)kp.addr;
	unregister_kprobe(&kp);
	return (bunshin_lookup_fn)bunshin_fix_endbr(addr);
}

static void *bunshin_lookup(bunshin_lookup_fn lookup, const char *name)
{
	unsigned long addr = lookup(name);

	if (!addr)
		pr_warn("kernel symbol %s not found\n", name);
	return (void *)addr;
}

int bunshin_ksyms_init(void)
{
	bunshin_lookup_fn lookup = bunshin_find_lookup();
	struct bunshin_ksyms *k = &bunshin_ksyms;

	memset(k, 0, sizeof(*k));
	if (!lookup)
		return -ENOENT;
	k->kernel_clone = bunshin_lookup(lookup, "kernel_clone");
	k->copy_process = bunshin_lookup(lookup, "copy_process");
	k->wake_up_new_task = bunshin_lookup(lookup, "wake_up_new_task");
	k->switch_task_namespaces = bunshin_lookup(lookup,
						   "switch_task_namespaces");
	k->tasklist_lock = bunshin_lookup(lookup, "tasklist_lock");
	k->resolved = k->kernel_clone && k->copy_process &&
		      k->wake_up_new_task && k->switch_task_namespaces &&
		      k->tasklist_lock;
	k->pidfd_get_pid = bunshin_lookup(lookup, "pidfd_get_pid");
	k->cgroup_leave_frozen = bunshin_lookup(lookup, "cgroup_leave_frozen");
	k->fork_ready = k->resolved && k->pidfd_get_pid &&
			k->cgroup_leave_frozen;
	k->dup_fd = bunshin_lookup(lookup, "dup_fd");
	k->put_files_struct = bunshin_lookup(lookup, "put_files_struct");
	k->replace_fd = bunshin_lookup(lookup, "replace_fd");
	k->d_path_under = bunshin_lookup(lookup, "__d_path");
	k->change_pid = bunshin_lookup(lookup, "change_pid");
	k->cgroup_ready = k->fork_ready && k->dup_fd && k->put_files_struct;
	k->files_ready = k->cgroup_ready && k->replace_fd && k->d_path_under;
	k->session_ready = k->fork_ready && k->change_pid;
	k->create_pipe_files = bunshin_lookup(lookup, "create_pipe_files");
	k->pipe_fcntl = bunshin_lookup(lookup, "pipe_fcntl");
	k->tree_ready = k->files_ready && k->session_ready &&
			k->create_pipe_files;
	k->ptm_open_peer = bunshin_lookup(lookup, "ptm_open_peer");
#ifdef CONFIG_LRU_GEN
	k->lru_gen_add_mm = bunshin_lookup(lookup, "lru_gen_add_mm");
#endif
	return k->resolved ? 0 : -ENOENT;
}
