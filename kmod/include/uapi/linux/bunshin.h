/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * bunshin.h: the ioctl interface of /dev/bunshin, the Bunshin kernel module.
 *
 * This header is the one contract between the module (kmod/) and user space
 * (cext/, the bunshin_async._bunshin_c extension). Every structure has a
 * fixed layout on every architecture: fixed-width fields, pointers passed as
 * __u64, explicit reserved padding. Reserved fields must be zero on input
 * (the call fails with EINVAL otherwise) and are zero on output, so they can
 * carry new inputs and outputs later without a new command number.
 *
 * Only CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE may issue these commands
 * (EPERM otherwise). An unknown command fails with ENOTTY, an unreadable or
 * unwritable argument with EFAULT.
 */
#ifndef _UAPI_LINUX_BUNSHIN_H
#define _UAPI_LINUX_BUNSHIN_H

#include <linux/ioctl.h>
#include <linux/types.h>

/* The ABI version this header describes (bunshin_version.abi_version). */
#define BUNSHIN_ABI_VERSION	1

/* The ioctl type byte of /dev/bunshin's commands. */
#define BUNSHIN_IOC_MAGIC	0xBB

/* bunshin_version.features: what this module can do. */
/* BUNSHIN_IOC_VERSION answers (always set). */
#define BUNSHIN_FEATURE_VERSION		(1ULL << 0)
/*
 * The kernel internals the fork command needs (kernel_clone, copy_process,
 * wake_up_new_task, switch_task_namespaces, tasklist_lock) were resolved
 * when the module loaded.
 */
#define BUNSHIN_FEATURE_FORK_SYMBOLS	(1ULL << 1)

/**
 * struct bunshin_version - argument of BUNSHIN_IOC_VERSION
 * @flags: in: must be 0.
 * @abi_version: out: BUNSHIN_ABI_VERSION of the running module.
 * @features: out: BUNSHIN_FEATURE_* bits.
 * @kernel_version: out: LINUX_VERSION_CODE the module was built for.
 * @reserved0: in: must be 0; out: 0.
 * @reserved: in: must be 0; out: 0.
 */
struct bunshin_version {
	__u32 flags;
	__u32 abi_version;
	__u64 features;
	__u32 kernel_version;
	__u32 reserved0;
	__u64 reserved[5];
};

#define BUNSHIN_IOC_VERSION	_IOWR(BUNSHIN_IOC_MAGIC, 0x00, struct bunshin_version)

#endif /* _UAPI_LINUX_BUNSHIN_H */
