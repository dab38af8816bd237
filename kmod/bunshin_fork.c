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
 *     the child take the signal path on its way out so that restart happens;
 *  4. reparents the child to the init of the target's pid namespace under
 *     tasklist_lock, and only then wakes it with wake_up_new_task(): it
 *     cannot run before it has its new parent;
 *  5. freezes again if the cgroup is still frozen (the child is in the
 *     source's cgroup and freezes on its first way out, too).
 *
 * The caller waits for a completion (with a timeout) and gets the child's
 * pid in its own pid namespace. "Frozen" means the source's cgroup is frozen:
 * the source may still be on its way into the freezer (right after a previous
 * fork, say), in which case the work runs there, just as well, before the
 * source can reach user mode.
 *
 * Known isolation holes of this first slice: the child keeps the source's
 * cgroup, session, process group, controlling tty, credentials, seccomp
 * filter, rlimits and a copy of its whole fd table.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bunshin.h>
#include <linux/capability.h>
#include <linux/cgroup.h>
#include <linux/completion.h>
#include <linux/fs_struct.h>
#include <linux/ktime.h>
#include <linux/module.h>
#include <linux/nsproxy.h>
#include <linux/path.h>
#include <linux/pid.h>
#include <linux/pid_namespace.h>
#include <linux/refcount.h>
#include <linux/sched.h>
#include <linux/sched/jobctl.h>
#include <linux/sched/signal.h>
#include <linux/sched/task.h>
#include <linux/sched/task_stack.h>
#include <linux/slab.h>
#include <linux/string.h>
#include <linux/task_work.h>
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
	struct pid *child;		/* out: reference */
	u64 source_ns;			/* out */
	int error;			/* out */
};

static void bunshin_fork_work_put(struct bunshin_fork_work *w)
{
	if (!refcount_dec_and_test(&w->refs))
		return;
	put_pid(w->child);
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
static bool bunshin_cgroup_frozen(struct task_struct *task)
{
	bool frozen;

	rcu_read_lock();
	frozen = test_bit(CGRP_FREEZE, &task_dfl_cgroup(task)->flags);
	rcu_read_unlock();
	return frozen;
}

/* Make path the child's root and cwd; consumes the references given. */
static void bunshin_set_child_fs(struct task_struct *p, struct path *root,
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

/* Move the new, never-run child p under reaper; false if reaper is gone. */
static bool bunshin_reparent(struct task_struct *p, struct task_struct *reaper)
{
	bool ok = false;

	write_lock_irq(bunshin_ksyms.tasklist_lock);
	/*
	 * exit_notify() hands the children on and sets exit_state in one
	 * tasklist_lock section: with exit_state still 0 the reaper's exit,
	 * if it comes, will see this child.
	 */
	if (!reaper->exit_state) {
		list_move_tail(&p->sibling, &reaper->children);
		p->real_parent = reaper;
		p->parent = reaper;
		p->parent_exec_id = reaper->self_exec_id;
		ok = !(reaper->flags & PF_EXITING);
	}
	write_unlock_irq(bunshin_ksyms.tasklist_lock);
	return ok;
}

/* Runs in the source's context (task_work). */
static int bunshin_fork_here(struct bunshin_fork_work *w)
{
	struct bunshin_ksyms *k = &bunshin_ksyms;
	struct kernel_clone_args args = { .exit_signal = SIGCHLD };
	struct task_struct *p, *target = w->target;
	struct nsproxy *new_ns, *old_ns;
	struct path root, pwd;
	u64 start = ktime_get_ns();
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
	new_ns = target->nsproxy;
	if (!new_ns || !target->fs) {
		task_unlock(target);
		return -ESRCH;
	}
	if (new_ns->pid_ns_for_children != task_active_pid_ns(target)) {
		task_unlock(target);
		return -EINVAL;
	}
	get_nsproxy(new_ns);
	get_fs_root(target->fs, &root);
	get_fs_pwd(target->fs, &pwd);
	task_unlock(target);

	/* Not frozen while forking: see the comment at the top. */
	if (current->frozen)
		k->cgroup_leave_frozen(true);
	spin_lock_irq(&current->sighand->siglock);
	current->jobctl &= ~JOBCTL_TRAP_FREEZE;
	spin_unlock_irq(&current->sighand->siglock);

	old_ns = current->nsproxy;
	get_nsproxy(old_ns);
	k->switch_task_namespaces(current, new_ns);	/* takes our new_ns ref */
	p = k->copy_process(NULL, 0, NUMA_NO_NODE, &args);
	k->switch_task_namespaces(current, old_ns);	/* takes our old_ns ref */

	/* Freeze again (get_signal() does) unless the cgroup thawed since. */
	spin_lock_irq(&current->sighand->siglock);
	rcu_read_lock();
	if (test_bit(CGRP_FREEZE, &task_dfl_cgroup(current)->flags)) {
		current->jobctl |= JOBCTL_TRAP_FREEZE;
		set_thread_flag(TIF_SIGPENDING);
	}
	rcu_read_unlock();
	spin_unlock_irq(&current->sighand->siglock);

	if (IS_ERR(p)) {
		path_put(&root);
		path_put(&pwd);
		err = PTR_ERR(p);
		/* A signal is pending: fork() would restart, we cannot. */
		return err == -ERESTARTNOINTR ? -EAGAIN : err;
	}

	bunshin_set_child_fs(p, &root, &pwd);
#ifdef CONFIG_X86_64
	task_pt_regs(p)->ax = task_pt_regs(current)->ax;
#endif
	/* Take the signal path first: freeze, then restart a system call. */
	set_tsk_thread_flag(p, TIF_SIGPENDING);
	if (k->lru_gen_add_mm) {
		task_lock(p);
		k->lru_gen_add_mm(p->mm);
		task_unlock(p);
	}

	if (!bunshin_reparent(p, w->reaper)) {
		/* The target's init is exiting: the child dies unseen. */
		send_sig(SIGKILL, p, 1);
		err = -ESRCH;
	} else {
		w->child = get_task_pid(p, PIDTYPE_PID);
	}
	k->wake_up_new_task(p);
	w->source_ns = ktime_get_ns() - start;
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
	if (req.flags || memchr_inv(req.reserved, 0, sizeof(req.reserved)))
		return -EINVAL;
	/* Fail on an unwritable argument before anything is made. */
	if (copy_to_user(uarg, &req, sizeof(req)))
		return -EFAULT;
	if (!bunshin_ksyms.fork_ready)
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
	refcount_set(&w->refs, 2);
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
