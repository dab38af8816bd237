/* SPDX-License-Identifier: GPL-2.0 */
/*
 * bunshin_internal.h: what the parts of the Bunshin module share.
 */
#ifndef BUNSHIN_INTERNAL_H
#define BUNSHIN_INTERNAL_H

#include <linux/pid.h>
#include <linux/types.h>

struct fd_range;
struct files_struct;
struct file;
struct kernel_clone_args;
struct mm_struct;
struct nsproxy;
struct path;
struct pid;
struct task_struct;
struct tty_struct;

/*
 * Kernel internals the fork command needs. None of them is exported to
 * modules: they are looked up by name through kallsyms_lookup_name(), itself
 * found through a kprobe (bunshin_ksyms.c). Every pointer is NULL until
 * bunshin_ksyms_init() succeeds; resolved says whether all were found.
 */
struct bunshin_ksyms {
	pid_t (*kernel_clone)(struct kernel_clone_args *args);
	struct task_struct *(*copy_process)(struct pid *pid, int trace,
					    int node,
					    struct kernel_clone_args *args);
	void (*wake_up_new_task)(struct task_struct *p);
	void (*switch_task_namespaces)(struct task_struct *p,
				       struct nsproxy *new);
	rwlock_t *tasklist_lock;
	bool resolved;
	/* Needed by BUNSHIN_IOC_FORK too; fork_ready says all were found. */
	struct pid *(*pidfd_get_pid)(unsigned int fd, unsigned int *flags);
	void (*cgroup_leave_frozen)(bool always_leave);
	bool fork_ready;
	/* Optional (NULL without CONFIG_LRU_GEN): what kernel_clone() does. */
	void (*lru_gen_add_mm)(struct mm_struct *mm);
	/* BUNSHIN_FORK_CGROUP and BUNSHIN_FORK_REOPEN_FILES: the child's table. */
#ifdef BUNSHIN_DUP_FD_RANGE
	struct files_struct *(*dup_fd)(struct files_struct *oldf,
				       struct fd_range *punch_hole);
#else
	struct files_struct *(*dup_fd)(struct files_struct *oldf,
				       unsigned int max_fds, int *errorp);
#endif
	void (*put_files_struct)(struct files_struct *files);
	/* BUNSHIN_FORK_REOPEN_FILES. */
	int (*replace_fd)(unsigned int fd, struct file *file,
			  unsigned int flags);
	char *(*d_path_under)(const struct path *path, const struct path *root,
			      char *buf, int buflen);	/* __d_path() */
	/* BUNSHIN_FORK_SETSID, BUNSHIN_FORK_JOIN_GROUP. */
	void (*change_pid)(struct task_struct *task, enum pid_type type,
			   struct pid *pid);
	bool cgroup_ready, session_ready, files_ready;
	/* BUNSHIN_IOC_FORK_TREE: tree_ready says it and the above all work. */
	int (*create_pipe_files)(struct file **res, int flags);
	long (*pipe_fcntl)(struct file *file, unsigned int cmd,
			   unsigned long arg);	/* optional */
	bool tree_ready;
	/* Optional: without it a pty pair in the tree is refused. */
	int (*ptm_open_peer)(struct file *master, struct tty_struct *tty,
			     int flags);
};

extern struct bunshin_ksyms bunshin_ksyms;

/* Resolve bunshin_ksyms; 0 on success, a negative errno otherwise. */
int bunshin_ksyms_init(void);

/* BUNSHIN_IOC_FORK (bunshin_fork.c). */
long bunshin_ioctl_fork(void __user *uarg);

/* What BUNSHIN_IOC_FORK_TREE (bunshin_tree.c) shares with it. */
bool bunshin_cgroup_frozen(struct task_struct *task);
void bunshin_set_child_fs(struct task_struct *p, struct path *root,
			  struct path *pwd);
void bunshin_leave_frozen(void);
void bunshin_refreeze(void);
void bunshin_child_resume_here(struct task_struct *p);
struct files_struct *bunshin_files_in(struct files_struct *files);
struct files_struct *bunshin_files_back(struct files_struct *own);
struct files_struct *bunshin_task_files(struct task_struct *task,
					struct path *root);
struct files_struct *bunshin_dup_files(struct files_struct *oldf);
struct file *bunshin_next_file(struct files_struct *files, unsigned int *fd,
			       bool *cloexec);
const char *bunshin_file_kind(struct file *file, char *buf, size_t len,
			      bool *ok);
struct file *bunshin_reopen(struct file *old, const struct path *src_root,
			    const struct path *dst_root, char *buf,
			    const char **name);
struct file *bunshin_fork_cgroup(int fd);

/* BUNSHIN_IOC_FORK_TREE (bunshin_tree.c). */
long bunshin_ioctl_fork_tree(void __user *uarg);

#endif /* BUNSHIN_INTERNAL_H */
