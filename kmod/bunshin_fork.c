// SPDX-License-Identifier: GPL-2.0
/*
 * bunshin_fork.c: BUNSHIN_IOC_FORK, a frozen process forks itself into the
 * namespaces of another process.
 *
 * The caller names a source (a single-threaded process frozen by the cgroup
 * v2 freezer) and a target (a pidfd). The fork must run in the source's own
 * context, because copy_process() copies "current": the caller queues a
 * task_work on the source with TWA_SIGNAL, which wakes it inside
 * do_freezer_trap(); since 6.1.98 that function runs pending task_work right
 * after schedule(). The work then:
 *
 *  1. leaves the frozen state for the duration of the fork (copy_process()
 *     refuses to fork while TIF_SIGPENDING is set, and a frozen task always
 *     has it set), through cgroup_leave_frozen() so the cgroup's counters stay
 *     right;
 *  2. swaps the target's nsproxy in, calls copy_process() (no CLONE_* flags:
 *     the memory is shared copy-on-write, the fd table is copied), and swaps
 *     its own nsproxy back;
 *  3. replaces the child's (private) root and cwd by the target's, keeps the
 *     source's register state (copy_thread() zeroes ax: an interrupted system
 *     call must restart, a user-mode register must keep its value), and makes
 *     the child take the signal path on its way out so that restart happens
 *     (TIF_NOTIFY_SIGNAL: TIF_SIGPENDING does not survive schedule_tail());
 *  4. reparents the child to the init of the target's pid namespace under
 *     tasklist_lock, and only then wakes it with wake_up_new_task(): it
 *     cannot run before it has its new parent;
 *  5. freezes again if the cgroup is still frozen (the child is in the
 *     source's cgroup and freezes on its first way out, too).
 *
 * Flags (the second slice) close isolation holes of that first version:
 *
 *  - BUNSHIN_FORK_CGROUP: the child is born in a given cgroup v2 directory,
 *    as with clone3()'s CLONE_INTO_CGROUP. That flag takes an fd number in
 *    the forking task's table, so the fork runs with a private copy of the
 *    source's fd table (dup_fd()) swapped in as current->files: the cgroup's
 *    file is installed there, copy_process() runs with CLONE_FILES |
 *    CLONE_INTO_CGROUP (the child shares that copy), the fd is closed again
 *    and the source's own table swapped back. The source's table is never
 *    changed.
 *  - BUNSHIN_FORK_REOPEN_FILES: in that same private copy, before the fork,
 *    every fd is replaced by the same file reopened in the target's root
 *    (regular files and directories at the same path, offset and flags; the
 *    memory devices null, zero, random, urandom). Any other kind refuses the
 *    whole fork before a task exists, and the kernel log names the fd.
 *  - BUNSHIN_FORK_SETSID, BUNSHIN_FORK_JOIN_GROUP: while the child is
 *    reparented (tasklist_lock held, never run yet), it gets a new session
 *    and process group, or those of a given process of the target, and
 *    loses the controlling tty it inherited.
 *
 * Known isolation holes that remain: without the flags, all of the above;
 * always the source's credentials, seccomp filter and rlimits.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bunshin.h>
#include <linux/capability.h>
#include <linux/cgroup.h>
#include <linux/completion.h>
#include <linux/dcache.h>
#include <linux/fdtable.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/fs_struct.h>
#include <linux/ktime.h>
#include <linux/magic.h>
#include <linux/major.h>
#include <linux/module.h>
#include <linux/nsproxy.h>
#include <linux/path.h>
#include <linux/pid.h>
#include <linux/pid_namespace.h>
#include <linux/refcount.h>
#include <linux/rwsem.h>
#include <linux/sched.h>
#include <linux/sched/jobctl.h>
#include <linux/sched/signal.h>
#include <linux/sched/task.h>
#include <linux/sched/task_stack.h>
#include <linux/slab.h>
#include <linux/string.h>
#include <linux/task_work.h>
#include <linux/tty.h>
#include <linux/uaccess.h>

#include "bunshin_internal.h"

/* How long the caller waits for the source to run the fork. */
#define BUNSHIN_FORK_TIMEOUT	(10 * HZ)

enum {
	BUNSHIN_FORK_QUEUED,
	BUNSHIN_FORK_RUNNING,
	BUNSHIN_FORK_CANCELLED,
};

/*
 * One fork request, shared by the caller and the task_work (one reference
 * each). The work also holds a module reference: it may run after the caller
 * gave up waiting.
 */
struct bunshin_fork_work {
	struct callback_head twork;
	refcount_t refs;
	atomic_t state;
	struct completion done;
	struct task_struct *target;	/* reference */
	struct task_struct *reaper;	/* reference: the child's parent */
	u32 flags;			/* BUNSHIN_FORK_* */
	struct file *cgroup_file;	/* reference, with BUNSHIN_FORK_CGROUP */
	struct task_struct *group;	/* reference, with JOIN_GROUP */
	struct pid *child;		/* out: reference */
	u64 source_ns;			/* out */
	int error;			/* out */
};

static void bunshin_fork_work_put(struct bunshin_fork_work *w)
{
	if (!refcount_dec_and_test(&w->refs))
		return;
	put_pid(w->child);
	if (w->cgroup_file)
		fput(w->cgroup_file);
	if (w->group)
		put_task_struct(w->group);
	put_task_struct(w->reaper);
	put_task_struct(w->target);
	kfree(w);
}

/*
 * The task's cgroup is frozen (cgroup.freeze is 1 for it or an ancestor):
 * the task is in the freezer, or on its way there and cannot return to user
 * mode before it is. A merely stopped task (which also counts as "frozen" for
 * the freezer's bookkeeping) is not enough.
 */
bool bunshin_cgroup_frozen(struct task_struct *task)
{
	bool frozen;

	rcu_read_lock();
	frozen = test_bit(CGRP_FREEZE, &task_dfl_cgroup(task)->flags);
	rcu_read_unlock();
	return frozen;
}

/* Make path the child's root and cwd; consumes the references given. */
void bunshin_set_child_fs(struct task_struct *p, struct path *root,
			  struct path *pwd)
{
	struct fs_struct *fs = p->fs;
	struct path old_root, old_pwd;

	spin_lock(&fs->lock);
	write_seqcount_begin(&fs->seq);
	old_root = fs->root;
	old_pwd = fs->pwd;
	fs->root = *root;
	fs->pwd = *pwd;
	write_seqcount_end(&fs->seq);
	spin_unlock(&fs->lock);
	path_put(&old_root);
	path_put(&old_pwd);
}

/* Leave the frozen state for a fork (see the comment at the top). */
void bunshin_leave_frozen(void)
{
	if (current->frozen)
		bunshin_ksyms.cgroup_leave_frozen(true);
	spin_lock_irq(&current->sighand->siglock);
	current->jobctl &= ~JOBCTL_TRAP_FREEZE;
	spin_unlock_irq(&current->sighand->siglock);
}

/* Freeze again (get_signal() does) unless the cgroup thawed since. */
void bunshin_refreeze(void)
{
	spin_lock_irq(&current->sighand->siglock);
	rcu_read_lock();
	if (test_bit(CGRP_FREEZE, &task_dfl_cgroup(current)->flags)) {
		current->jobctl |= JOBCTL_TRAP_FREEZE;
		set_thread_flag(TIF_SIGPENDING);
	}
	rcu_read_unlock();
	spin_unlock_irq(&current->sighand->siglock);
}

/*
 * Make the new child p of current resume where current is: same registers,
 * and the signal path first (freeze, then restart a system call).
 */
void bunshin_child_resume_here(struct task_struct *p)
{
#ifdef CONFIG_X86_64
	task_pt_regs(p)->ax = task_pt_regs(current)->ax;
#endif
	/*
	 * TIF_SIGPENDING alone is not enough: the child's first
	 * schedule_tail() recalculates it (calculate_sigpending()) and clears
	 * it unless JOBCTL_TRAP_FREEZE is still set, so a cgroup thawed
	 * before the child first runs would let it return an -ERESTART* code
	 * to user mode. TIF_NOTIFY_SIGNAL survives that and still leads
	 * through arch_do_signal_or_restart().
	 */
	set_tsk_thread_flag(p, TIF_SIGPENDING);
	set_tsk_thread_flag(p, TIF_NOTIFY_SIGNAL);
	if (bunshin_ksyms.lru_gen_add_mm) {
		task_lock(p);
		bunshin_ksyms.lru_gen_add_mm(p->mm);
		task_unlock(p);
	}
}

/* --- the child's fd table (BUNSHIN_FORK_CGROUP, BUNSHIN_FORK_REOPEN_FILES) */

/* Open flags a reopened file keeps; O_CLOEXEC is the fd's and kept too. */
#define BUNSHIN_REOPEN_FLAGS	(O_ACCMODE | O_APPEND | O_NONBLOCK | O_DSYNC | \
				 __O_SYNC | O_DIRECT | O_LARGEFILE | \
				 O_DIRECTORY | O_NOFOLLOW | O_NOATIME | O_PATH)

/*
 * A source makes its fork with another fd table than its own as
 * current->files (the copy that holds the cgroup's fd, the clone's table).
 * A tree fork reads each source's table from the caller's context: read
 * while another request had its table swapped in, it would be that
 * request's table, its files reopened in another target, and the fork
 * refused (or worse). Every swap holds this shared until the source's own
 * table is back; those reads hold it exclusive.
 */
static DECLARE_RWSEM(bunshin_swap_sem);

static struct files_struct *bunshin_swap_files(struct files_struct *files)
{
	struct files_struct *old;

	task_lock(current);
	old = current->files;
	current->files = files;
	task_unlock(current);
	return old;
}

/* Make files current's table until bunshin_files_back(); returns its own. */
struct files_struct *bunshin_files_in(struct files_struct *files)
{
	down_read(&bunshin_swap_sem);
	return bunshin_swap_files(files);
}

/* Give current its own table back; returns the one it replaces. */
struct files_struct *bunshin_files_back(struct files_struct *own)
{
	struct files_struct *files = bunshin_swap_files(own);

	up_read(&bunshin_swap_sem);
	return files;
}

/*
 * A reference to task's own fd table (never one a fork swapped in), and its
 * root in *root; an ERR_PTR if it has none (exiting) or the caller is killed.
 */
struct files_struct *bunshin_task_files(struct task_struct *task,
					struct path *root)
{
	struct files_struct *files = NULL;

	if (down_write_killable(&bunshin_swap_sem))
		return ERR_PTR(-EINTR);
	task_lock(task);
	if (task->files && task->fs) {
		files = task->files;
		atomic_inc(&files->count);
		get_fs_root(task->fs, root);
	}
	task_unlock(task);
	up_write(&bunshin_swap_sem);
	return files ?: ERR_PTR(-ESRCH);
}

/* A private copy of the fd table oldf, or an ERR_PTR. */
struct files_struct *bunshin_dup_files(struct files_struct *oldf)
{
	struct files_struct *files;
	int err = -ENOMEM;

#ifdef BUNSHIN_DUP_FD_RANGE
	files = bunshin_ksyms.dup_fd(oldf, NULL);
#else
	files = bunshin_ksyms.dup_fd(oldf, ~0U, &err);	/* all */
#endif
	if (!files)
		return ERR_PTR(err);
	return files;
}

/* Give current back its own table and drop the reference to the copy. */
static void bunshin_restore_files(struct files_struct *own)
{
	bunshin_ksyms.put_files_struct(bunshin_files_back(own));
}

/* The next open file at or after *fd in files, a reference, or NULL. */
struct file *bunshin_next_file(struct files_struct *files, unsigned int *fd,
			       bool *cloexec)
{
	struct file *file = NULL;
	struct fdtable *fdt;

	spin_lock(&files->file_lock);
	fdt = files_fdtable(files);
	while (*fd < fdt->max_fds) {
		*fd = find_next_bit(fdt->open_fds, fdt->max_fds, *fd);
		if (*fd >= fdt->max_fds)
			break;
		file = rcu_dereference_protected(fdt->fd[*fd],
				lockdep_is_held(&files->file_lock));
		if (file) {
			get_file(file);
			*cloexec = close_on_exec(*fd, fdt);
			break;
		}
		(*fd)++;
	}
	spin_unlock(&files->file_lock);
	return file;
}

/* The memory devices a child gets reopened: null, zero, random, urandom. */
static bool bunshin_reopenable_chrdev(dev_t rdev)
{
	return MAJOR(rdev) == MEM_MAJOR &&
	       (MINOR(rdev) == 3 || MINOR(rdev) == 5 || MINOR(rdev) == 8 ||
		MINOR(rdev) == 9);
}

/*
 * What kind of file this is, for the kernel log (buf may hold the answer);
 * *ok says whether BUNSHIN_FORK_REOPEN_FILES reopens that kind.
 */
const char *bunshin_file_kind(struct file *file, char *buf, size_t len,
			      bool *ok)
{
	struct inode *inode = file_inode(file);
	bool unlinked = d_unlinked(file->f_path.dentry);

	*ok = false;
	switch (inode->i_mode & S_IFMT) {
	case S_IFREG:
		*ok = !unlinked;
		return unlinked ? "deleted or anonymous regular file" :
				  "regular file";
	case S_IFDIR:
		*ok = !unlinked;
		return unlinked ? "deleted directory" : "directory";
	case S_IFCHR:
		*ok = bunshin_reopenable_chrdev(inode->i_rdev);
		snprintf(buf, len, "character device %u:%u",
			 MAJOR(inode->i_rdev), MINOR(inode->i_rdev));
		return buf;
	case S_IFBLK:
		return "block device";
	case S_IFIFO:
		return inode->i_sb->s_magic == PIPEFS_MAGIC ? "pipe" : "FIFO";
	case S_IFSOCK:
		return "socket";
	case S_IFLNK:
		return "symbolic link";
	default:
		snprintf(buf, len, "anonymous inode %pd", file->f_path.dentry);
		return buf;
	}
}

/*
 * old, reopened at the same path under dst_root (src_root is the source's
 * root): same flags, same offset, same kind of file. A reference, or an
 * ERR_PTR; name is set to the path when there is one.
 */
struct file *bunshin_reopen(struct file *old, const struct path *src_root,
			    const struct path *dst_root, char *buf,
			    const char **name)
{
	struct inode *inode = file_inode(old), *now;
	struct file *file;
	loff_t pos;

	*name = bunshin_ksyms.d_path_under(&old->f_path, src_root, buf,
					   PATH_MAX);
	if (IS_ERR(*name)) {
		file = ERR_CAST(*name);
		*name = NULL;
		return file;
	}
	if (!*name)	/* not under the source's root */
		return ERR_PTR(-EXDEV);
	file = file_open_root(dst_root, *name,
			      old->f_flags & BUNSHIN_REOPEN_FLAGS, 0);
	if (IS_ERR(file))
		return file;
	now = file_inode(file);
	if ((now->i_mode ^ inode->i_mode) & S_IFMT ||
	    (S_ISCHR(inode->i_mode) && now->i_rdev != inode->i_rdev)) {
		fput(file);
		return ERR_PTR(-EINVAL);
	}
	if (!(old->f_mode & FMODE_PATH) && (file->f_mode & FMODE_LSEEK)) {
		pos = vfs_llseek(file, READ_ONCE(old->f_pos), SEEK_SET);
		if (pos < 0) {
			fput(file);
			return ERR_PTR(pos);
		}
	}
	return file;
}

/*
 * Replace every fd of files (current's table, a private copy of the
 * source's) by its file reopened under dst_root. Any fd that cannot be
 * reopened fails it all (the caller drops the copy).
 */
static int bunshin_reopen_files(struct files_struct *files,
				const struct path *dst_root)
{
	struct file *old, *file;
	const char *kind, *name;
	struct path src_root;
	unsigned int fd = 0;
	char kbuf[64], *buf;
	bool cloexec, ok;
	int err = 0;

	buf = kmalloc(PATH_MAX, GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	get_fs_root(current->fs, &src_root);
	for (; (old = bunshin_next_file(files, &fd, &cloexec)); fd++) {
		kind = bunshin_file_kind(old, kbuf, sizeof(kbuf), &ok);
		if (!ok) {
			pr_info("fork: source pid %d: fd %u is a %s: this kind is not reopened yet, the fork is refused\n",
				task_pid_nr(current), fd, kind);
			err = -EINVAL;
		} else {
			file = bunshin_reopen(old, &src_root, dst_root, buf,
					      &name);
			if (IS_ERR(file)) {
				err = PTR_ERR(file);
				pr_info("fork: source pid %d: fd %u is a %s (%s) that cannot be reopened in the target: error %d\n",
					task_pid_nr(current), fd, kind,
					name ?: "outside the source's root",
					err);
				if (err == -EXDEV)
					err = -EINVAL;
			} else {
				err = bunshin_ksyms.replace_fd(fd, file,
						cloexec ? O_CLOEXEC : 0);
				fput(file);
				if (err > 0)
					err = 0;
			}
		}
		fput(old);
		if (err)
			break;
	}
	path_put(&src_root);
	kfree(buf);
	return err;
}

/* --- reparenting, session and process group ----------------------------- */

/*
 * Move the new, never-run child p under the reaper and give it its session
 * and process group; a negative errno if the reaper or the group's process
 * is gone. The child's tty reference, if it loses it, goes to *tty.
 */
static int bunshin_adopt(struct bunshin_fork_work *w, struct task_struct *p,
			 struct tty_struct **tty)
{
	struct bunshin_ksyms *k = &bunshin_ksyms;
	struct task_struct *reaper = w->reaper, *g = w->group;
	struct pid *sid, *pgrp;
	int err = -ESRCH;

	write_lock_irq(k->tasklist_lock);
	/*
	 * exit_notify() hands the children on and sets exit_state in one
	 * tasklist_lock section: with exit_state still 0 the reaper's exit,
	 * if it comes, will see this child.
	 */
	if (reaper->exit_state)
		goto unlock;
	list_move_tail(&p->sibling, &reaper->children);
	p->real_parent = reaper;
	p->parent = reaper;
	p->parent_exec_id = reaper->self_exec_id;
	if (reaper->flags & PF_EXITING)
		goto unlock;

	if (w->flags & BUNSHIN_FORK_SETSID) {
		/* What setsid() does: its own pid is no process group yet. */
		sid = task_pid(p);
		pgrp = sid;
		p->signal->leader = 1;
	} else if (g) {
		sid = g->exit_state ? NULL : task_session(g);
		pgrp = g->exit_state ? NULL : task_pgrp(g);
		if (!sid || !pgrp)
			goto unlock;
	} else {
		err = 0;
		goto unlock;
	}
	k->change_pid(p, PIDTYPE_SID, sid);
	k->change_pid(p, PIDTYPE_PGID, pgrp);
	spin_lock(&p->sighand->siglock);
	*tty = p->signal->tty;
	p->signal->tty = NULL;
	spin_unlock(&p->sighand->siglock);
	err = 0;
unlock:
	write_unlock_irq(k->tasklist_lock);
	return err;
}

/* Runs in the source's context (task_work). */
static int bunshin_fork_here(struct bunshin_fork_work *w)
{
	struct bunshin_ksyms *k = &bunshin_ksyms;
	struct kernel_clone_args args = { .exit_signal = SIGCHLD };
	struct task_struct *p, *target = w->target;
	struct files_struct *files = NULL, *own_files = NULL;
	struct nsproxy *new_ns, *old_ns;
	struct tty_struct *tty = NULL;
	struct path root, pwd;
	u64 start = ktime_get_ns();
	int cgroup_fd = -1;
	int err = 0;

	if (current->flags & PF_EXITING)
		return -ESRCH;
	if (!thread_group_empty(current)) {
		pr_info("fork: source pid %d is multi-threaded\n",
			task_pid_nr(current));
		return -EINVAL;
	}
	if (!bunshin_cgroup_frozen(current))
		return -EBUSY;

	task_lock(target);
	if (!target->nsproxy || !target->fs) {
		task_unlock(target);
		return -ESRCH;
	}
	get_fs_root(target->fs, &root);
	get_fs_pwd(target->fs, &pwd);
	task_unlock(target);

	/* The child's fd table: a private copy, current's while it is made. */
	if (w->flags & (BUNSHIN_FORK_CGROUP | BUNSHIN_FORK_REOPEN_FILES)) {
		files = bunshin_dup_files(current->files);
		if (IS_ERR(files)) {
			err = PTR_ERR(files);
			files = NULL;
			goto put_paths;
		}
		own_files = bunshin_files_in(files);
		if (w->flags & BUNSHIN_FORK_REOPEN_FILES) {
			err = bunshin_reopen_files(files, &root);
			if (err)
				goto put_files;
		}
		if (w->cgroup_file) {
			cgroup_fd = get_unused_fd_flags(O_CLOEXEC);
			if (cgroup_fd < 0) {
				err = cgroup_fd;
				goto put_files;
			}
			fd_install(cgroup_fd, get_file(w->cgroup_file));
			args.flags |= CLONE_INTO_CGROUP;
			args.cgroup = cgroup_fd;
		}
		args.flags |= CLONE_FILES;
	}

	task_lock(target);
	new_ns = target->nsproxy;
	if (!new_ns) {
		task_unlock(target);
		err = -ESRCH;
		goto put_files;
	}
	if (new_ns->pid_ns_for_children != task_active_pid_ns(target)) {
		task_unlock(target);
		err = -EINVAL;
		goto put_files;
	}
	get_nsproxy(new_ns);
	task_unlock(target);

	bunshin_leave_frozen();

	old_ns = current->nsproxy;
	get_nsproxy(old_ns);
	k->switch_task_namespaces(current, new_ns);	/* takes our new_ns ref */
	p = k->copy_process(NULL, 0, NUMA_NO_NODE, &args);
	k->switch_task_namespaces(current, old_ns);	/* takes our old_ns ref */

	bunshin_refreeze();

	if (files) {
		/* The child shares the copy: the cgroup's fd leaves it. */
		if (cgroup_fd >= 0 && !IS_ERR(p))
			close_fd(cgroup_fd);
		bunshin_restore_files(own_files);
		files = NULL;
	}
	if (IS_ERR(p)) {
		err = PTR_ERR(p);
		if (w->cgroup_file && err != -ERESTARTNOINTR)
			pr_info("fork: source pid %d: cannot fork into the given cgroup: error %d\n",
				task_pid_nr(current), err);
		/* A signal is pending: fork() would restart, we cannot. */
		if (err == -ERESTARTNOINTR)
			err = -EAGAIN;
		goto put_paths;
	}

	bunshin_set_child_fs(p, &root, &pwd);
	bunshin_child_resume_here(p);

	err = bunshin_adopt(w, p, &tty);
	if (err)	/* the target's init or the group is gone */
		send_sig(SIGKILL, p, 1);	/* the child dies unseen */
	else
		w->child = get_task_pid(p, PIDTYPE_PID);
	k->wake_up_new_task(p);
	tty_kref_put(tty);
	w->source_ns = ktime_get_ns() - start;
	return err;

put_files:
	if (files)
		bunshin_restore_files(own_files);
put_paths:
	path_put(&root);
	path_put(&pwd);
	return err;
}

static void bunshin_fork_twork(struct callback_head *head)
{
	struct bunshin_fork_work *w =
		container_of(head, struct bunshin_fork_work, twork);

	if (atomic_cmpxchg(&w->state, BUNSHIN_FORK_QUEUED,
			   BUNSHIN_FORK_RUNNING) == BUNSHIN_FORK_QUEUED) {
		w->error = bunshin_fork_here(w);
		complete(&w->done);
	}
	bunshin_fork_work_put(w);
	module_put(THIS_MODULE);
}

/* The source task, checked; a reference, or an ERR_PTR. */
static struct task_struct *bunshin_fork_source(pid_t nr)
{
	struct task_struct *task;
	struct pid *pid;
	int threads;

	if (nr <= 0)
		return ERR_PTR(-ESRCH);
	pid = find_get_pid(nr);
	task = pid ? get_pid_task(pid, PIDTYPE_PID) : NULL;
	put_pid(pid);
	if (!task)
		return ERR_PTR(-ESRCH);
	if ((task->flags & (PF_KTHREAD | PF_IO_WORKER)) ||
	    same_thread_group(task, current)) {
		put_task_struct(task);
		return ERR_PTR(-EINVAL);
	}
	threads = get_nr_threads(task);
	if (threads != 1) {
		pr_info("fork: source pid %d has %d threads: multi-threaded sources are refused\n",
			nr, threads);
		put_task_struct(task);
		return ERR_PTR(-EINVAL);
	}
	if (!bunshin_cgroup_frozen(task)) {
		put_task_struct(task);
		return ERR_PTR(-EBUSY);
	}
	return task;
}

/* The target (from its pidfd) and the init of its pid namespace. */
static int bunshin_fork_target(int pidfd, struct task_struct **target,
			       struct task_struct **reaper)
{
	struct task_struct *t, *r = NULL;
	unsigned int fflags;
	struct pid *pid;

	if (pidfd < 0)
		return -EBADF;
	pid = bunshin_ksyms.pidfd_get_pid(pidfd, &fflags);
	if (IS_ERR(pid))
		return PTR_ERR(pid);
	t = get_pid_task(pid, PIDTYPE_PID);
	put_pid(pid);
	if (!t)
		return -ESRCH;
	if (t->flags & PF_KTHREAD) {
		put_task_struct(t);
		return -EINVAL;
	}
	rcu_read_lock();
	r = task_active_pid_ns(t) ? task_active_pid_ns(t)->child_reaper : NULL;
	if (r)
		get_task_struct(r);
	rcu_read_unlock();
	/* The child must be visible to the caller: report its pid. */
	if (!r || !task_pid_vnr(r)) {
		if (r)
			put_task_struct(r);
		put_task_struct(t);
		return r ? -EINVAL : -ESRCH;
	}
	*target = t;
	*reaper = r;
	return 0;
}

/* The cgroup v2 directory cgroup_fd names: a reference to its file. */
struct file *bunshin_fork_cgroup(int fd)
{
	struct cgroup *cgrp;
	struct file *file;

	if (fd < 0)
		return ERR_PTR(-EBADF);
	cgrp = cgroup_get_from_fd(fd);	/* EBADF unless a v2 cgroup */
	if (IS_ERR(cgrp))
		return ERR_CAST(cgrp);
	cgroup_put(cgrp);
	file = fget_raw(fd);
	return file ?: ERR_PTR(-EBADF);
}

/* The process group_pidfd refers to, in the target's pid namespace. */
static struct task_struct *bunshin_fork_group(int pidfd,
					      struct task_struct *target)
{
	struct pid_namespace *ns;
	struct task_struct *g;
	unsigned int fflags;
	struct pid *pid;

	if (pidfd < 0)
		return ERR_PTR(-EBADF);
	pid = bunshin_ksyms.pidfd_get_pid(pidfd, &fflags);
	if (IS_ERR(pid))
		return ERR_CAST(pid);
	g = get_pid_task(pid, PIDTYPE_PID);
	put_pid(pid);
	if (!g)
		return ERR_PTR(-ESRCH);
	rcu_read_lock();
	ns = task_active_pid_ns(g);
	rcu_read_unlock();
	if (!ns || ns != task_active_pid_ns(target) ||
	    (g->flags & PF_KTHREAD)) {
		put_task_struct(g);
		return ERR_PTR(ns ? -EINVAL : -ESRCH);
	}
	return g;
}

/* The request's flags and the fields they use are consistent. */
static bool bunshin_fork_req_valid(const struct bunshin_fork_req *req)
{
	u32 f = req->flags;

	if (f & ~BUNSHIN_FORK_FLAGS)
		return false;
	if ((f & BUNSHIN_FORK_SETSID) && (f & BUNSHIN_FORK_JOIN_GROUP))
		return false;
	if (!(f & BUNSHIN_FORK_CGROUP) && req->cgroup_fd)
		return false;
	if (!(f & BUNSHIN_FORK_JOIN_GROUP) && req->group_pidfd)
		return false;
	return !memchr_inv(req->reserved, 0, sizeof(req->reserved));
}

/* Every flag asked for is backed by resolved kernel internals. */
static bool bunshin_fork_supported(u32 f)
{
	struct bunshin_ksyms *k = &bunshin_ksyms;

	if (!k->fork_ready)
		return false;
	if ((f & BUNSHIN_FORK_CGROUP) && !k->cgroup_ready)
		return false;
	if ((f & (BUNSHIN_FORK_SETSID | BUNSHIN_FORK_JOIN_GROUP)) &&
	    !k->session_ready)
		return false;
	return !(f & BUNSHIN_FORK_REOPEN_FILES) || k->files_ready;
}

long bunshin_ioctl_fork(void __user *uarg)
{
	struct bunshin_fork_req req;
	struct bunshin_fork_work *w;
	struct task_struct *source;
	long left;
	int ret;

	if (!capable(CAP_SYS_ADMIN))
		return -EPERM;
	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!bunshin_fork_req_valid(&req))
		return -EINVAL;
	/* Fail on an unwritable argument before anything is made. */
	if (copy_to_user(uarg, &req, sizeof(req)))
		return -EFAULT;
	if (!bunshin_fork_supported(req.flags))
		return -EOPNOTSUPP;

	source = bunshin_fork_source(req.source_pid);
	if (IS_ERR(source))
		return PTR_ERR(source);

	w = kzalloc(sizeof(*w), GFP_KERNEL);
	if (!w) {
		ret = -ENOMEM;
		goto put_source;
	}
	ret = bunshin_fork_target(req.target_pidfd, &w->target, &w->reaper);
	if (ret) {
		kfree(w);
		goto put_source;
	}
	refcount_set(&w->refs, 1);
	w->flags = req.flags;
	if (req.flags & BUNSHIN_FORK_CGROUP) {
		w->cgroup_file = bunshin_fork_cgroup(req.cgroup_fd);
		if (IS_ERR(w->cgroup_file)) {
			ret = PTR_ERR(w->cgroup_file);
			w->cgroup_file = NULL;
			goto put_work;
		}
	}
	if (req.flags & BUNSHIN_FORK_JOIN_GROUP) {
		w->group = bunshin_fork_group(req.group_pidfd, w->target);
		if (IS_ERR(w->group)) {
			ret = PTR_ERR(w->group);
			w->group = NULL;
			goto put_work;
		}
	}
	refcount_inc(&w->refs);	/* the work's */
	atomic_set(&w->state, BUNSHIN_FORK_QUEUED);
	init_completion(&w->done);
	init_task_work(&w->twork, bunshin_fork_twork);

	__module_get(THIS_MODULE);
	ret = task_work_add(source, &w->twork, TWA_SIGNAL);
	if (ret) {
		module_put(THIS_MODULE);
		bunshin_fork_work_put(w);	/* the work's reference */
		goto put_work;
	}

	left = wait_for_completion_killable_timeout(&w->done,
						    BUNSHIN_FORK_TIMEOUT);
	if (left <= 0) {
		if (atomic_cmpxchg(&w->state, BUNSHIN_FORK_QUEUED,
				   BUNSHIN_FORK_CANCELLED) ==
		    BUNSHIN_FORK_QUEUED) {
			/* The work stays queued and will do nothing. */
			ret = left ? -EINTR : -ETIMEDOUT;
			if (!left)
				pr_info("fork: source pid %d did not run the fork in time\n",
					req.source_pid);
			goto put_work;
		}
		wait_for_completion(&w->done);	/* running: it ends soon */
	}
	ret = w->error;
	if (ret)
		goto put_work;

	req.child_pid = pid_vnr(w->child);
	req.source_ns = w->source_ns;
	if (copy_to_user(uarg, &req, sizeof(req))) {
		kill_pid(w->child, SIGKILL, 1);
		ret = -EFAULT;
	}
put_work:
	bunshin_fork_work_put(w);
put_source:
	put_task_struct(source);
	return ret;
}
