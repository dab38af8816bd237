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
/*
 * 2: struct bunshin_fork_req gained flags and the fields cgroup_fd and
 * group_pidfd (in what were reserved[0]); a request with flags 0 means what it
 * meant in version 1.
 * 3: BUNSHIN_IOC_FORK_TREE and struct bunshin_tree_req (BUNSHIN_IOC_FORK is
 * unchanged).
 * 4: BUNSHIN_TREE_SUBST: struct bunshin_tree_req gained the fields subst and
 * subst_count (in what were reserved[0] and reserved[1]); a request with
 * flags 0 means what it meant in version 3.
 */
#define BUNSHIN_ABI_VERSION	4

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
/*
 * BUNSHIN_IOC_FORK works: the fork internals and the further ones it needs
 * (pidfd_get_pid, cgroup_leave_frozen) were resolved.
 */
#define BUNSHIN_FEATURE_FORK		(1ULL << 2)
/* BUNSHIN_FORK_CGROUP works (dup_fd, put_files_struct resolved). */
#define BUNSHIN_FEATURE_FORK_CGROUP	(1ULL << 3)
/* BUNSHIN_FORK_SETSID and BUNSHIN_FORK_JOIN_GROUP work (change_pid). */
#define BUNSHIN_FEATURE_FORK_SESSION	(1ULL << 4)
/* BUNSHIN_FORK_REOPEN_FILES works (replace_fd, __d_path too). */
#define BUNSHIN_FEATURE_FORK_FILES	(1ULL << 5)
/*
 * BUNSHIN_IOC_FORK_TREE works: every internal the flags above need, and
 * create_pipe_files, were resolved.
 */
#define BUNSHIN_FEATURE_FORK_TREE	(1ULL << 6)
/* BUNSHIN_IOC_FORK_TREE takes BUNSHIN_TREE_SUBST (fd substitutions). */
#define BUNSHIN_FEATURE_TREE_SUBST	(1ULL << 7)

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

/* bunshin_fork_req.flags */
/*
 * The child is born in the cgroup v2 directory cgroup_fd names (as with
 * clone3's CLONE_INTO_CGROUP, checked with the source's credentials and the
 * target's cgroup namespace), not in the source's cgroup.
 */
#define BUNSHIN_FORK_CGROUP		(1U << 0)
/* The child leads a new session and process group and has no tty. */
#define BUNSHIN_FORK_SETSID		(1U << 1)
/*
 * The child joins the session and process group of the process group_pidfd
 * refers to (in the target's pid namespace), and has no controlling tty.
 */
#define BUNSHIN_FORK_JOIN_GROUP		(1U << 2)
/*
 * The child's fd table holds the source's fds reopened in the target's root:
 * regular files and directories at the same path, offset and flags, and
 * /dev/null, /dev/zero, /dev/random, /dev/urandom. Any other kind of fd
 * (socket, pipe, FIFO, tty, eventfd, a deleted or unreachable file, ...)
 * fails the whole fork with EINVAL, and the kernel log names the source's
 * pid, the fd and its kind.
 */
#define BUNSHIN_FORK_REOPEN_FILES	(1U << 3)
#define BUNSHIN_FORK_FLAGS		(BUNSHIN_FORK_CGROUP | \
					 BUNSHIN_FORK_SETSID | \
					 BUNSHIN_FORK_JOIN_GROUP | \
					 BUNSHIN_FORK_REOPEN_FILES)

/**
 * struct bunshin_fork_req - argument of BUNSHIN_IOC_FORK
 * @flags: in: BUNSHIN_FORK_* bits (0: the behaviour of ABI version 1).
 * @source_pid: in: the process to fork, a pid in the caller's pid namespace.
 *	It must be single-threaded and frozen by the cgroup v2 freezer.
 * @target_pidfd: in: a pidfd of a process whose namespaces (pid, mount,
 *	network, UTS, IPC, cgroup, time), root and working directory the child
 *	gets. The child's parent is the init of that pid namespace, which must
 *	be the target's pid namespace for children too.
 * @child_pid: out: the child's pid in the caller's pid namespace.
 * @source_ns: out: nanoseconds the source spent running the fork.
 * @cgroup_fd: in: with BUNSHIN_FORK_CGROUP, an fd of a cgroup v2 directory
 *	(O_PATH is enough); 0 otherwise.
 * @group_pidfd: in: with BUNSHIN_FORK_JOIN_GROUP, a pidfd of a process in
 *	the target's pid namespace; 0 otherwise.
 * @reserved: in: must be 0; out: 0.
 *
 * Errors: EINVAL (unknown flags, SETSID with JOIN_GROUP, a nonzero
 * reserved field or a field its flag does not use, a multi-threaded source,
 * a kernel thread, the caller itself, a target whose pid namespace for
 * children is not its own, a group process in another pid namespace, an fd
 * REOPEN_FILES cannot reopen), ESRCH (no such source, target or group
 * process, or it exited midway), EBUSY (the source is not frozen), EBADF
 * (target_pidfd or group_pidfd is not a pidfd, cgroup_fd is not a cgroup v2
 * directory), EAGAIN (the source has a signal pending), ETIMEDOUT (the
 * source did not run the fork in time), EINTR (the caller was killed while
 * waiting), EPERM (the caller lacks CAP_SYS_ADMIN: CAP_CHECKPOINT_RESTORE
 * alone is not enough for this command), EOPNOTSUPP (see
 * BUNSHIN_FEATURE_FORK and the BUNSHIN_FEATURE_FORK_* bits); what opening a
 * file in the target or CLONE_INTO_CGROUP can fail with (ENOENT, EACCES,
 * EROFS, ENODEV, EBUSY, ...).
 */
struct bunshin_fork_req {
	__u32 flags;
	__s32 source_pid;
	__s32 target_pidfd;
	__s32 child_pid;
	__u64 source_ns;
	__s32 cgroup_fd;
	__s32 group_pidfd;
	__u64 reserved[4];
};

#define BUNSHIN_IOC_FORK	_IOWR(BUNSHIN_IOC_MAGIC, 0x01, struct bunshin_fork_req)

/* The most processes one BUNSHIN_IOC_FORK_TREE request may name. */
#define BUNSHIN_TREE_MAX	1024
/* The most fd substitutions one BUNSHIN_IOC_FORK_TREE request may carry. */
#define BUNSHIN_TREE_SUBST_MAX	1024

/* bunshin_tree_req.flags */
/*
 * subst points to subst_count struct bunshin_tree_subst: the clones get the
 * caller's open files at the fds they name instead of what the module would
 * make of the sources' files there.
 */
#define BUNSHIN_TREE_SUBST		(1U << 0)
#define BUNSHIN_TREE_FLAGS		BUNSHIN_TREE_SUBST

/**
 * struct bunshin_tree_subst - one fd substitution of BUNSHIN_IOC_FORK_TREE
 * @index: in: the source, an index into source_pids.
 * @fd: in: an fd number the source has open.
 * @caller_fd: in: an fd of the caller: its open file (shared, not copied) is
 *	what the clone of that source holds at @fd, with the source's
 *	close-on-exec bit. The source's own file at @fd is not looked at: a
 *	socket whose peer is outside the tree (the controller's end of a
 *	channel) may be replaced this way. Another source's fd sharing that
 *	open file is not substituted by this entry (give it its own).
 * @reserved: in: must be 0.
 */
struct bunshin_tree_subst {
	__u32 index;
	__u32 fd;
	__s32 caller_fd;
	__u32 reserved;
};

/**
 * struct bunshin_tree_req - argument of BUNSHIN_IOC_FORK_TREE
 * @flags: in: BUNSHIN_TREE_* bits (0: the behaviour of ABI version 3).
 * @count: in: the number of pids at @source_pids (1 to BUNSHIN_TREE_MAX).
 * @source_pids: in: a user pointer to __s32[count], the processes to fork
 *	(pids in the caller's pid namespace), each one's parent before it:
 *	source_pids[0] is the root of the tree, and the parent of every other
 *	one is an earlier entry. All must be in the root's pid namespace,
 *	single-threaded and frozen by the cgroup v2 freezer.
 * @child_pids: in: a user pointer to __s32[count]; out: there, the clone of
 *	each source (same index), a pid in the caller's pid namespace.
 * @target_pidfd: in: a pidfd of the target: the clones get its mount,
 *	network, UTS, IPC, cgroup and time namespaces, root and working
 *	directory, and the pid namespace its children get. If that pid
 *	namespace is the target's own, the clone of the root is a child of its
 *	init; if it is a new, still empty one (the target called
 *	unshare(CLONE_NEWPID) and has no child there yet), the clone of the
 *	root becomes its init (pid 1), a child of the target.
 * @cgroup_fd: in: a cgroup v2 directory (O_PATH is enough) every clone is
 *	born in, as with clone3()'s CLONE_INTO_CGROUP; freeze it first for the
 *	clones to start frozen.
 * @source_ns: out: nanoseconds the sources spent running the forks, summed.
 * @subst: in: with BUNSHIN_TREE_SUBST, a user pointer to struct
 *	bunshin_tree_subst[subst_count]; 0 otherwise.
 * @subst_count: in: with BUNSHIN_TREE_SUBST, 1 to BUNSHIN_TREE_SUBST_MAX;
 *	0 otherwise.
 * @reserved0: in: must be 0; out: 0.
 * @reserved: in: must be 0; out: 0.
 *
 * Every clone keeps its source's pid in the target's pid namespace where that
 * pid is free; its parent is the clone of its source's parent; its session
 * and process group are the clones' of its source's (one led by a process
 * outside the tree: the root clone's); it has no controlling tty; it has its
 * source's credentials (the cgroup and pid checks are made with the needed
 * capabilities raised: the caller asks for them). Its fds are
 * its source's: regular files, directories and the memory devices reopened
 * in the target's root (one reopened file per source open file), pipes and
 * unix socket pairs with both ends in the tree recreated with their buffered
 * data (one new pipe or pair per source pipe or pair, every fd of the tree
 * that shared an end shares the new end), FIFOs reopened at the same path in
 * the target (unused there) and given the buffered data. Any other fd fails
 * the whole request with EINVAL, the kernel log naming the process, fd and
 * kind. An fd named by a substitution holds the caller's file instead.
 *
 * Errors: those of BUNSHIN_IOC_FORK with BUNSHIN_FORK_CGROUP and
 * BUNSHIN_FORK_REOPEN_FILES, EBUSY (also: another request made the init of
 * the target's new pid namespace first), and EINVAL (count 0 or above the maximum, a
 * source whose parent is not an earlier entry, sources in several pid
 * namespaces, the same pid twice, a target whose pid namespace for children
 * is neither its own nor a new empty one, a pipe, FIFO or socket with an end
 * outside the tree, a multi-threaded source; unknown flags, a substitution
 * naming an index out of range, an fd the source has not open or one fd
 * twice, a nonzero reserved field of one), EBADF (a caller_fd not open),
 * EFAULT (subst unreadable). On any error no clone is left:
 * those made are killed before they ever ran, and the sources resume
 * untouched.
 */
struct bunshin_tree_req {
	__u32 flags;
	__u32 count;
	__u64 source_pids;
	__u64 child_pids;
	__s32 target_pidfd;
	__s32 cgroup_fd;
	__u64 source_ns;
	__u64 subst;
	__u32 subst_count;
	__u32 reserved0;
	__u64 reserved[1];
};

#define BUNSHIN_IOC_FORK_TREE	_IOWR(BUNSHIN_IOC_MAGIC, 0x02, struct bunshin_tree_req)

#endif /* _UAPI_LINUX_BUNSHIN_H */
