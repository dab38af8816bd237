// SPDX-License-Identifier: GPL-2.0
/*
 * bunshin_tree.c: BUNSHIN_IOC_FORK_TREE, a frozen process tree forks itself
 * into the namespaces of a target, keeping its shape.
 *
 * The caller names the tree's processes, each one's parent before it, a
 * target (a pidfd) and a cgroup v2 directory. The request runs in three
 * phases; nothing runs in the target before the last one succeeded.
 *
 *  1. Tables (in the caller's context, with each source's credentials): a
 *     private copy of every source's fd table is made and every fd in it
 *     replaced. One map per request (source struct file -> new struct file)
 *     makes every fd of the tree that shares an open file share its
 *     replacement: regular files, directories and memory devices are
 *     reopened in the target's root (as BUNSHIN_FORK_REOPEN_FILES does), a
 *     pipe becomes a new pipe holding a copy of the buffered bytes, a FIFO
 *     is reopened at its path in the target (an unused FIFO there) and
 *     given a copy of the bytes, a unix socket pair becomes a new pair
 *     holding copies of both queues, a pty pair a new master from the
 *     target's /dev/ptmx and its peer slave (termios and window size
 *     copied, buffered bytes not). Then every pipe, FIFO and pair is
 *     checked to have all its ends in the tree. Any other kind of fd fails
 *     the request here, before any task exists.
 *  2. Forks (in each source's context, task_work as in bunshin_fork.c,
 *     parent before child): the source swaps in its prepared table and the
 *     target's nsproxy and calls copy_process() with CLONE_FILES |
 *     CLONE_INTO_CGROUP, and with set_tid (as clone3() does) to keep its
 *     pid where it is free in the target's pid namespace, its credentials
 *     raised for the kernel's checks of both (lowered again in the child's
 *     copy). The child is not woken.
 *  3. Adoption (in the caller's context, one tasklist_lock section): every
 *     clone is moved under the clone of its source's parent (the root clone
 *     under the target's init, or under the target if the clone is the init
 *     of the target's new pid namespace) and gets the clones' session and
 *     process group (and the new slave of its source's controlling tty, if
 *     that pair was recreated); then all are woken, parents first. On
 *     any error every clone made is killed before it is woken: it never
 *     runs.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bunshin.h>
#include <linux/capability.h>
#include <linux/cred.h>
#include <linux/fdtable.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/fs_struct.h>
#include <linux/hashtable.h>
#include <linux/highmem.h>
#include <linux/ktime.h>
#include <linux/magic.h>
#include <linux/major.h>
#include <linux/memcontrol.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/net.h>
#include <linux/nsproxy.h>
#include <linux/path.h>
#include <linux/pid.h>
#include <linux/pid_namespace.h>
#include <linux/pipe_fs_i.h>
#include <linux/refcount.h>
#include <linux/sched.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
#include <linux/sched/task.h>
#include <linux/skbuff.h>
#include <linux/slab.h>
#include <linux/socket.h>
#include <linux/string.h>
#include <linux/task_work.h>
#include <linux/tty.h>
#include <linux/uaccess.h>
#include <net/af_unix.h>
#include <net/net_namespace.h>
#include <net/sock.h>

#include "bunshin_internal.h"

/* How long the caller waits for one source to run its fork. */
#define BUNSHIN_TREE_TIMEOUT	(10 * HZ)

enum {
	BUNSHIN_TREE_QUEUED,
	BUNSHIN_TREE_RUNNING,
	BUNSHIN_TREE_CANCELLED,
};

/* One source process and its clone. */
struct bunshin_tree_proc {
	struct task_struct *source;	/* reference */
	const struct cred *cred;	/* reference: the source's */
	struct files_struct *files;	/* reference: the clone's table */
	struct task_struct *clone;	/* reference; woken in phase 3 */
	int parent;			/* index of the parent; -1: the root */
	pid_t nr, sid_nr, pgid_nr;	/* in the sources' pid namespace */
	int exit_signal;
	bool subreaper;
	u64 ns;				/* spent forking, in the source */
	struct tty_struct *tty;		/* reference: the source's ctty */
};

/* A source open file and the one that replaces it in the clones. */
struct bunshin_tree_map {
	struct hlist_node node;
	struct file *src;		/* reference */
	struct file *dst;		/* reference */
	pid_t pid;			/* the first holder (global pid), */
	unsigned int fd;		/* and its fd: for the kernel log */
	bool seen;			/* an fd of the tree holds src */
	const char *unseen;		/* for the log if not: "a ... whose" */
};

/*
 * A source pipe or FIFO and the new one that replaces it: a new pipe, or
 * the FIFO at the same path in the target (end[0] then holds it open for
 * reading and writing while the request runs, end[1] is NULL).
 */
struct bunshin_tree_pipe {
	struct list_head node;
	struct pipe_inode_info *src;	/* kept alive by the map's files */
	struct file *end[2];		/* references: new read, write end */
	struct file *src_end[2];	/* a pipe: the tree's file of each end */
	unsigned int n[2];		/* the tree's files reading, writing */
	pid_t pid;
	unsigned int fd;
};

/* A new unix socket and the source one it replaces (the map keeps both). */
struct bunshin_tree_sock {
	struct list_head node;
	struct sock *src, *dst;
};

/*
 * A source pty pair (Unix98, devpts) and the new one that replaces it: a new
 * master opened from the target's /dev/ptmx; each source slave file becomes
 * a new open file of its peer slave (ptm_open_peer()).
 */
struct bunshin_tree_pty {
	struct list_head node;
	struct tty_struct *src;		/* reference: the source master */
	struct file *master;		/* reference: the new master */
	struct pid *sid, *pgrp;		/* references: the source slave's */
	pid_t pid;			/* the first holder and its fd */
	unsigned int fd;
};

/* A caller's file that replaces a source's fd in its clone. */
struct bunshin_tree_subst_k {
	unsigned int index, fd;
	struct file *file;		/* reference */
	bool used;
};

struct bunshin_tree {
	struct task_struct *target;	/* reference */
	struct task_struct *reaper;	/* reference: the root clone's parent */
	struct pid_namespace *pid_ns;	/* reference: the clones' */
	struct net *net;		/* reference: the target's */
	struct file *cgroup_file;	/* reference */
	struct cgroup_subsys_state *memcg_css;	/* reference: the clones' */
	struct path root, pwd;		/* references: the target's */
	bool new_init;			/* the root clone is pid_ns's init */
	pid_t spare;			/* no source's pid from here on */
	unsigned int count, made;
	struct bunshin_tree_proc *procs;
	struct bunshin_tree_subst_k *subst;
	unsigned int subst_count;
	DECLARE_HASHTABLE(files, 8);
	struct list_head pipes, socks, ptys;
	struct files_struct *table;	/* the clone's table being made */
	char *buf;			/* PATH_MAX */
};

/* --- phase 1: the clones' fd tables ------------------------------------ */

static struct bunshin_tree_map *bunshin_tree_lookup(struct bunshin_tree *t,
						    struct file *src)
{
	struct bunshin_tree_map *m;

	hash_for_each_possible(t->files, m, node, (unsigned long)src)
		if (m->src == src)
			return m;
	return NULL;
}

/*
 * Map src to dst (consumes the reference to dst); returns a new reference
 * to dst for the table, or an ERR_PTR.
 */
static struct file *bunshin_tree_add(struct bunshin_tree *t, pid_t pid,
				     unsigned int fd, struct file *src,
				     struct file *dst, bool seen)
{
	struct bunshin_tree_map *m = kzalloc(sizeof(*m), GFP_KERNEL);

	if (!m) {
		fput(dst);
		return ERR_PTR(-ENOMEM);
	}
	m->src = get_file(src);
	m->dst = dst;
	m->pid = pid;
	m->fd = fd;
	m->seen = seen;
	hash_add(t->files, &m->node, (unsigned long)src);
	return get_file(dst);
}

/* Put file at fd of files, a private table no task uses yet. */
static void bunshin_tree_set_fd(struct files_struct *files, unsigned int fd,
				struct file *file)
{
	struct fdtable *fdt;
	struct file *old;

	spin_lock(&files->file_lock);
	fdt = files_fdtable(files);
	old = rcu_dereference_protected(fdt->fd[fd],
					lockdep_is_held(&files->file_lock));
	rcu_assign_pointer(fdt->fd[fd], file);
	spin_unlock(&files->file_lock);
	if (old)
		fput(old);
}

/*
 * The bytes buffered in the source pipe src, written into the new pipe whose
 * write end is wr (non-blocking, empty), with the same capacity.
 */
static int bunshin_tree_copy_pipe(struct pipe_inode_info *src,
				  struct file *wr)
{
	struct pipe_inode_info *dst = wr->private_data;
	unsigned int head, tail, mask, i, n, max_usage;
	struct pipe_buffer *buf;
	size_t total = 0, pos = 0;
	loff_t off = 0;
	char *data = NULL, *page;
	u32 *lens = NULL;
	ssize_t done;
	long ret;
	int err = 0;

	pipe_lock(src);
	head = src->head;
	tail = src->tail;
	mask = src->ring_size - 1;
	max_usage = src->max_usage;
	n = head - tail;
	for (i = tail; i != head; i++)
		total += src->bufs[i & mask].len;
	if (n) {
		data = kvmalloc(total ?: 1, GFP_KERNEL);
		lens = kvmalloc_array(n, sizeof(*lens), GFP_KERNEL);
		if (!data || !lens)
			err = -ENOMEM;
	}
	for (i = tail; !err && i != head; i++) {
		buf = &src->bufs[i & mask];
		err = pipe_buf_confirm(src, buf);
		if (err)
			break;
		page = kmap_local_page(buf->page);
		memcpy(data + pos, page + buf->offset, buf->len);
		kunmap_local(page);
		/* The top bit: the buffer is a packet (O_DIRECT pipe). */
		lens[i - tail] = buf->len |
			((buf->flags & PIPE_BUF_FLAG_PACKET) ? BIT(31) : 0);
		pos += buf->len;
	}
	pipe_unlock(src);
	if (err)
		goto out;

	if (max_usage != dst->max_usage) {
		ret = -EOPNOTSUPP;
		if (bunshin_ksyms.pipe_fcntl)
			ret = bunshin_ksyms.pipe_fcntl(wr, F_SETPIPE_SZ,
						(unsigned long)max_usage <<
						PAGE_SHIFT);
		/* A smaller pipe can still take the bytes: try. */
		if (ret < 0 && max_usage > dst->max_usage) {
			err = ret;
			goto out;
		}
	}
	for (pos = 0, i = 0; i < n; i++) {
		size_t len = lens[i] & ~BIT(31);

		spin_lock(&wr->f_lock);
		if (lens[i] & BIT(31))
			wr->f_flags |= O_DIRECT;
		else
			wr->f_flags &= ~O_DIRECT;
		spin_unlock(&wr->f_lock);
		if (!len)
			continue;
		done = kernel_write(wr, data + pos, len, &off);
		if (done != len) {
			err = done < 0 ? done : -ENOSPC;
			goto out;
		}
		pos += len;
	}
out:
	kvfree(lens);
	kvfree(data);
	return err;
}

/* A new pipe for the source pipe src, holding its bytes. */
static struct bunshin_tree_pipe *
bunshin_tree_new_pipe(struct bunshin_tree *t, pid_t pid, unsigned int fd,
		      struct pipe_inode_info *src)
{
	struct bunshin_tree_pipe *tp;
	struct file *res[2];
	int err;

#ifdef CONFIG_WATCH_QUEUE
	if (src->watch_queue) {
		pr_info("tree fork: source pid %d: fd %u is a notification pipe: this kind is not carried over, the fork is refused\n",
			pid, fd);
		return ERR_PTR(-EINVAL);
	}
#endif
	tp = kzalloc(sizeof(*tp), GFP_KERNEL);
	if (!tp)
		return ERR_PTR(-ENOMEM);
	err = bunshin_ksyms.create_pipe_files(res, O_NONBLOCK);
	if (err) {
		kfree(tp);
		return ERR_PTR(err);
	}
	tp->src = src;
	tp->end[0] = res[0];
	tp->end[1] = res[1];
	tp->pid = pid;
	tp->fd = fd;
	list_add_tail(&tp->node, &t->pipes);	/* freed with the tree */
	err = bunshin_tree_copy_pipe(src, res[1]);
	if (err) {
		pr_info("tree fork: source pid %d: fd %u is a pipe whose buffered bytes cannot be copied: error %d\n",
			pid, fd, err);
		return ERR_PTR(err);
	}
	return tp;
}

/* The new end of a pipe for the source file old (an end of a pipe). */
static struct file *bunshin_tree_pipe_end(struct bunshin_tree *t, pid_t pid,
					  unsigned int fd, struct file *old)
{
	struct pipe_inode_info *src = old->private_data;
	struct bunshin_tree_pipe *tp, *found = NULL;
	fmode_t mode = old->f_mode & (FMODE_READ | FMODE_WRITE);
	struct file *dst;
	int end;

	if (mode != FMODE_READ && mode != FMODE_WRITE) {
		pr_info("tree fork: source pid %d: fd %u is a pipe open for both reading and writing: this is not carried over, the fork is refused\n",
			pid, fd);
		return ERR_PTR(-EINVAL);
	}
	end = mode == FMODE_WRITE;
	list_for_each_entry(tp, &t->pipes, node) {
		if (tp->src == src) {
			found = tp;
			break;
		}
	}
	if (!found) {
		found = bunshin_tree_new_pipe(t, pid, fd, src);
		if (IS_ERR(found))
			return ERR_CAST(found);
	}
	if (found->src_end[end]) {
		pr_info("tree fork: source pid %d: fd %u is a second open file of the %s end of a pipe: this is not carried over, the fork is refused\n",
			pid, fd, end ? "write" : "read");
		return ERR_PTR(-EINVAL);
	}
	found->src_end[end] = old;
	found->n[end]++;
	dst = found->end[end];
	spin_lock(&dst->f_lock);
	dst->f_flags = (dst->f_flags & ~(O_NONBLOCK | O_DIRECT)) |
		       (old->f_flags & (O_NONBLOCK | O_DIRECT));
	spin_unlock(&dst->f_lock);
	return bunshin_tree_add(t, pid, fd, old, get_file(dst), true);
}

/*
 * The FIFO at the same path in the target, for the source FIFO file old:
 * one new file per source file, all on the target's FIFO, which holds a
 * copy of the source's buffered bytes. It must be unused in the target.
 */
static struct file *bunshin_tree_fifo(struct bunshin_tree *t, pid_t pid,
				      unsigned int fd, struct file *old,
				      const struct path *src_root)
{
	struct pipe_inode_info *src = old->private_data, *dst;
	struct bunshin_tree_pipe *tp, *found = NULL;
	const char *name, *why = NULL;
	struct file *file;
	bool busy;
	int err;

	name = bunshin_ksyms.d_path_under(&old->f_path, src_root, t->buf,
					  PATH_MAX);
	if (IS_ERR_OR_NULL(name)) {
		pr_info("tree fork: source pid %d: fd %u is a FIFO outside the source's root: the fork is refused\n",
			pid, fd);
		return ERR_PTR(-EINVAL);
	}
	list_for_each_entry(tp, &t->pipes, node) {
		if (tp->src == src) {
			found = tp;
			break;
		}
	}
	if (!found) {
		found = kzalloc(sizeof(*found), GFP_KERNEL);
		if (!found)
			return ERR_PTR(-ENOMEM);
		found->src = src;
		found->pid = pid;
		found->fd = fd;
		list_add_tail(&found->node, &t->pipes);	/* freed with the tree */
		/* Open for both: no open of one end waits for the other. */
		file = file_open_root(&t->root, name, O_RDWR | O_NONBLOCK, 0);
		if (IS_ERR(file)) {
			err = PTR_ERR(file);
			why = "cannot be opened in the target";
			goto refuse;
		}
		found->end[0] = file;
		err = -EINVAL;
		why = "is not a FIFO in the target";
		if (!S_ISFIFO(file_inode(file)->i_mode))
			goto refuse;
		dst = file->private_data;
		pipe_lock(dst);
		busy = dst->readers != 1 || dst->writers != 1 ||
		       !pipe_empty(dst->head, dst->tail);
		pipe_unlock(dst);
		why = "is in use in the target";
		if (busy)
			goto refuse;
		why = "holds bytes that cannot be copied";
		err = bunshin_tree_copy_pipe(src, file);
		if (err)
			goto refuse;
	}
	file = file_open_root(&t->root, name,
			      (old->f_flags & O_ACCMODE) | O_NONBLOCK, 0);
	if (IS_ERR(file)) {
		err = PTR_ERR(file);
		why = "cannot be opened in the target";
		goto refuse;
	}
	if (file_inode(file) != file_inode(found->end[0])) {
		fput(file);
		err = -EINVAL;
		why = "was replaced in the target";
		goto refuse;
	}
	spin_lock(&file->f_lock);
	file->f_flags = (file->f_flags & ~O_NONBLOCK) |
			(old->f_flags & O_NONBLOCK);
	spin_unlock(&file->f_lock);
	if (old->f_mode & FMODE_READ)
		found->n[0]++;
	if (old->f_mode & FMODE_WRITE)
		found->n[1]++;
	return bunshin_tree_add(t, pid, fd, old, file, true);

refuse:
	pr_info("tree fork: source pid %d: fd %u is a FIFO (%s) that %s: the fork is refused (error %d)\n",
		pid, fd, name, why, err);
	return ERR_PTR(err);
}

/*
 * The messages queued for the source unix socket src, sent again through
 * from (the new peer of src's replacement). Returns a negative errno; *why
 * names what made it fail, for the log.
 */
static int bunshin_tree_copy_queue(struct sock *src, struct socket *from,
				   const char **why)
{
	struct sk_buff_head *q = &src->sk_receive_queue;
	bool stream = src->sk_type == SOCK_STREAM;
	struct msghdr msg = { .msg_flags = MSG_DONTWAIT | MSG_NOSIGNAL };
	size_t total = 0, pos = 0, len;
	unsigned int n = 0, i = 0;
	struct sk_buff *skb;
	unsigned long irq;
	struct kvec vec;
	char *data = NULL;
	u32 *lens = NULL;
	int sndbuf, err = 0, sent;

#if IS_ENABLED(CONFIG_AF_UNIX_OOB)
	if (READ_ONCE(unix_sk(src)->oob_skb)) {
		*why = "holds out-of-band data";
		return -EINVAL;
	}
#endif
	spin_lock_irqsave(&q->lock, irq);
	skb_queue_walk(q, skb) {
		if (UNIXCB(skb).fp) {
			err = -EINVAL;
			break;
		}
		n++;
		total += skb->len - UNIXCB(skb).consumed;
	}
	spin_unlock_irqrestore(&q->lock, irq);
	if (err) {
		*why = "has file descriptors in flight";
		return err;
	}
	if (!n)
		return 0;
	*why = "has a queue that cannot be copied";
	data = kvmalloc(total ?: 1, GFP_KERNEL);
	lens = kvmalloc_array(n, sizeof(*lens), GFP_KERNEL);
	if (!data || !lens) {
		err = -ENOMEM;
		goto out;
	}
	spin_lock_irqsave(&q->lock, irq);
	skb_queue_walk(q, skb) {
		len = skb->len - UNIXCB(skb).consumed;
		if (i == n || pos + len > total) {
			err = -EAGAIN;
			break;
		}
		err = skb_copy_bits(skb, UNIXCB(skb).consumed, data + pos,
				    len);
		if (err)
			break;
		lens[i++] = len;
		pos += len;
	}
	spin_unlock_irqrestore(&q->lock, irq);
	if (err)
		goto out;

	/* Room for all of it at once (it fitted in the source's queue). */
	sndbuf = READ_ONCE(from->sk->sk_sndbuf);
	WRITE_ONCE(from->sk->sk_sndbuf, INT_MAX / 2);
	for (pos = 0, i = 0; i < n && !err; i++) {
		len = stream ? total - pos : lens[i];
		while (len) {
			vec.iov_base = data + pos;
			vec.iov_len = len;
			sent = kernel_sendmsg(from, &msg, &vec, 1, len);
			if (sent <= 0) {
				err = sent ?: -ENOSPC;
				break;
			}
			if (!stream && sent != len) {
				err = -EMSGSIZE;
				break;
			}
			pos += sent;
			len -= sent;
		}
		if (stream)
			break;
	}
	WRITE_ONCE(from->sk->sk_sndbuf, sndbuf);
out:
	kvfree(lens);
	kvfree(data);
	return err;
}

/* What a new unix socket keeps of the source one. */
static void bunshin_tree_sock_opts(struct sock *src, struct sock *dst)
{
	WRITE_ONCE(dst->sk_sndbuf, READ_ONCE(src->sk_sndbuf));
	WRITE_ONCE(dst->sk_rcvbuf, READ_ONCE(src->sk_rcvbuf));
	dst->sk_userlocks = src->sk_userlocks;
	if (src->sk_socket && test_bit(SOCK_PASSCRED, &src->sk_socket->flags))
		set_bit(SOCK_PASSCRED, &dst->sk_socket->flags);
	if (src->sk_socket && test_bit(SOCK_PASSSEC, &src->sk_socket->flags))
		set_bit(SOCK_PASSSEC, &dst->sk_socket->flags);
}

/* Remember dst replaces src, for its SO_PEERCRED (bunshin_tree_peercred). */
static int bunshin_tree_note_sock(struct bunshin_tree *t, struct sock *src,
				  struct sock *dst)
{
	struct bunshin_tree_sock *ts = kzalloc(sizeof(*ts), GFP_KERNEL);

	if (!ts)
		return -ENOMEM;
	ts->src = src;
	ts->dst = dst;
	list_add_tail(&ts->node, &t->socks);
	return 0;
}

/* A new socket pair for the unix socket old and its peer. */
static struct file *bunshin_tree_unix(struct bunshin_tree *t, pid_t pid,
				      unsigned int fd, struct file *old)
{
	struct socket *sock = sock_from_file(old), *na = NULL, *nb = NULL;
	struct sock *sk = sock ? sock->sk : NULL, *peer = NULL;
	struct file *fa = NULL, *fb = NULL, *peer_file = NULL, *ret = NULL;
	const char *why = "is not one end of a socket pair (socketpair())";
	int err = -EINVAL;

	if (!sk || sk->sk_family != AF_UNIX) {
		pr_info("tree fork: source pid %d: fd %u is a socket (family %d): this kind is not carried over, the fork is refused\n",
			pid, fd, sk ? sk->sk_family : -1);
		return ERR_PTR(-EINVAL);
	}
	peer = unix_peer_get(sk);
	if (!peer || peer == sk || unix_sk(sk)->addr || unix_sk(peer)->addr)
		goto refuse;
	unix_state_lock(peer);
	if (unix_peer(peer) != sk)
		err = -EINVAL;
	else
		err = 0;
	unix_state_unlock(peer);
	if (err)
		goto refuse;
	read_lock_bh(&peer->sk_callback_lock);
	if (peer->sk_socket && peer->sk_socket->file &&
	    get_file_rcu(peer->sk_socket->file))
		peer_file = peer->sk_socket->file;
	read_unlock_bh(&peer->sk_callback_lock);
	if (!peer_file) {
		why = "has a closed peer";
		err = -EINVAL;
		goto refuse;
	}

	why = "cannot be made again in the target";
	err = __sock_create(t->net, AF_UNIX, sk->sk_type, 0, &na, 0);
	if (err)
		goto refuse;
	err = __sock_create(t->net, AF_UNIX, sk->sk_type, 0, &nb, 0);
	if (err)
		goto refuse;
	err = na->ops->socketpair(na, nb);
	if (err)
		goto refuse;
	bunshin_tree_sock_opts(sk, na->sk);
	bunshin_tree_sock_opts(peer, nb->sk);
	fa = sock_alloc_file(na, old->f_flags & O_NONBLOCK, NULL);
	na = NULL;			/* released on failure too */
	if (IS_ERR(fa)) {
		err = PTR_ERR(fa);
		fa = NULL;
		goto refuse;
	}
	fb = sock_alloc_file(nb, peer_file->f_flags & O_NONBLOCK, NULL);
	nb = NULL;
	if (IS_ERR(fb)) {
		err = PTR_ERR(fb);
		fb = NULL;
		goto refuse;
	}
	/* What waits for sk is sent again by fb's socket to fa's. */
	err = bunshin_tree_copy_queue(sk, sock_from_file(fb), &why);
	if (!err)
		err = bunshin_tree_copy_queue(peer, sock_from_file(fa), &why);
	if (err)
		goto refuse;

	err = bunshin_tree_note_sock(t, sk, sock_from_file(fa)->sk);
	if (!err)
		err = bunshin_tree_note_sock(t, peer, sock_from_file(fb)->sk);
	if (err)
		goto out;
	/* The peer's fd has not been seen yet: checked in bunshin_tree_check. */
	ret = bunshin_tree_add(t, pid, fd, peer_file, fb, peer_file == old);
	fb = NULL;
	if (IS_ERR(ret)) {
		err = PTR_ERR(ret);
		goto out;
	}
	fput(ret);
	ret = bunshin_tree_add(t, pid, fd, old, fa, true);
	fa = NULL;
	if (IS_ERR(ret))
		err = PTR_ERR(ret);
	goto out;

refuse:
	pr_info("tree fork: source pid %d: fd %u is a unix socket that %s: the fork is refused (error %d)\n",
		pid, fd, why, err);
out:
	if (fa)
		fput(fa);
	if (fb)
		fput(fb);
	if (na)
		sock_release(na);
	if (nb)
		sock_release(nb);
	if (peer_file)
		fput(peer_file);
	if (peer)
		sock_put(peer);
	return err ? ERR_PTR(err) : ret;
}

/* Terminals: the tty, console and pty majors. */
static bool bunshin_is_tty(struct inode *inode)
{
	unsigned int major = MAJOR(inode->i_rdev);

	return S_ISCHR(inode->i_mode) &&
	       (major == TTY_MAJOR || major == TTYAUX_MAJOR ||
		(major >= UNIX98_PTY_MASTER_MAJOR &&
		 major < UNIX98_PTY_SLAVE_MAJOR + UNIX98_PTY_MAJOR_COUNT));
}

/* The tty of an open file of a Unix98 pty (either end), or NULL. */
static struct tty_struct *bunshin_pty_of(struct file *file)
{
	struct tty_file_private *priv = file->private_data;
	struct inode *inode = file_inode(file);
	unsigned int major = imajor(inode);
	struct tty_struct *tty;

	if (!S_ISCHR(inode->i_mode) || (file->f_mode & FMODE_PATH) || !priv)
		return NULL;
	if (inode->i_rdev != MKDEV(TTYAUX_MAJOR, 2) &&
	    (major < UNIX98_PTY_SLAVE_MAJOR ||
	     major >= UNIX98_PTY_SLAVE_MAJOR + UNIX98_PTY_MAJOR_COUNT))
		return NULL;
	tty = priv->tty;
	if (!tty || !tty->link || tty->driver->type != TTY_DRIVER_TYPE_PTY ||
	    !(tty->driver->flags & TTY_DRIVER_DEVPTS_MEM))
		return NULL;
	return tty;
}

/* A reference to an open file of tty (a pty master has one), or NULL. */
static struct file *bunshin_tty_file(struct tty_struct *tty)
{
	struct tty_file_private *priv;
	struct file *file = NULL;

	spin_lock(&tty->files_lock);
	list_for_each_entry(priv, &tty->tty_files, list) {
		if (get_file_rcu(priv->file)) {
			file = priv->file;
			break;
		}
	}
	spin_unlock(&tty->files_lock);
	return file;
}

/*
 * The new pair for the source pty whose master is src: a new master opened
 * from /dev/ptmx in the target's root (its devpts), whose slave gets the
 * source slave's termios and window size, mapped from the source master's
 * file (not yet seen if the tree's fd met is a slave).
 */
static struct bunshin_tree_pty *
bunshin_tree_new_pty(struct bunshin_tree *t, pid_t pid, unsigned int fd,
		     struct tty_struct *src)
{
	struct tty_struct *slave = src->link, *mtty;
	struct file *src_master, *master, *ret;
	const char *why = "whose master is closed";
	struct bunshin_tree_pty *tp;
	struct tty_ldisc *ld;
	struct ktermios kt;
	struct winsize ws;
	int err = -EINVAL, num;
	bool packet;

	list_for_each_entry(tp, &t->ptys, node)
		if (tp->src == src)
			return tp;

	src_master = bunshin_tty_file(src);
	if (!src_master)
		goto refuse;
	ld = tty_ldisc_ref(slave);
	num = ld ? ld->ops->num : -1;
	if (ld)
		tty_ldisc_deref(ld);
	why = "has another line discipline than N_TTY";
	if (num != N_TTY)
		goto refuse_put;
	tp = kzalloc(sizeof(*tp), GFP_KERNEL);
	if (!tp) {
		err = -ENOMEM;
		goto put;
	}
	tp->src = tty_kref_get(src);
	tp->pid = pid;
	tp->fd = fd;
	list_add_tail(&tp->node, &t->ptys);	/* freed with the tree */

	why = "cannot be made again in the target (/dev/ptmx)";
	master = file_open_root(&t->root, "/dev/ptmx",
				O_RDWR | O_NOCTTY | (src_master->f_flags &
				(O_NONBLOCK | O_LARGEFILE)), 0);
	if (IS_ERR(master)) {
		err = PTR_ERR(master);
		goto refuse_put;
	}
	tp->master = master;
	mtty = bunshin_pty_of(master);
	err = -EINVAL;
	if (!mtty || mtty->driver->subtype != PTY_TYPE_MASTER)
		goto refuse_put;
	/* Unlocked for the peers' opens; the source's lock is set back later. */
	clear_bit(TTY_PTY_LOCK, &mtty->flags);

	why = "has a termios or window size that cannot be set in the target";
	down_read(&slave->termios_rwsem);
	kt = slave->termios;
	up_read(&slave->termios_rwsem);
	err = tty_set_termios(mtty->link, &kt);
	if (err)
		goto refuse_put;
	mutex_lock(&slave->winsize_mutex);
	ws = slave->winsize;
	mutex_unlock(&slave->winsize_mutex);
	err = tty_do_resize(mtty->link, &ws);
	if (err)
		goto refuse_put;
	spin_lock_irq(&src->ctrl.lock);
	packet = src->ctrl.packet;
	spin_unlock_irq(&src->ctrl.lock);
	spin_lock_irq(&mtty->ctrl.lock);
	mtty->ctrl.packet = packet;
	spin_unlock_irq(&mtty->ctrl.lock);

	ret = bunshin_tree_add(t, pid, fd, src_master, get_file(master), false);
	if (IS_ERR(ret)) {
		err = PTR_ERR(ret);
		goto put;
	}
	fput(ret);
	bunshin_tree_lookup(t, src_master)->unseen = "a pty slave whose master";
	fput(src_master);
	return tp;

refuse_put:
	fput(src_master);
refuse:
	pr_info("tree fork: source pid %d: fd %u is a pty (%s) that %s: the fork is refused (error %d)\n",
		pid, fd, slave->name, why, err);
	return ERR_PTR(err);
put:
	fput(src_master);
	return ERR_PTR(err);
}

/* A new open file of the new pair's slave for the source slave file old. */
static struct file *bunshin_tree_pty_slave(struct bunshin_tree *t, pid_t pid,
					   unsigned int fd, struct file *old,
					   struct bunshin_tree_pty *tp)
{
	int flags = (old->f_flags & (O_ACCMODE | O_NONBLOCK | O_APPEND |
				     O_LARGEFILE)) | O_NOCTTY;
	struct files_struct *own;
	struct file *file;
	int nfd;

	/*
	 * ptm_open_peer() installs the file in current's fd table: the
	 * clone's private one is swapped in for it, and the fd taken out
	 * again, so the caller's table never sees it. O_NOCTTY: the opener
	 * never gets it as controlling tty.
	 */
	own = bunshin_files_in(t->table);
	nfd = bunshin_ksyms.ptm_open_peer(tp->master, bunshin_pty_of(tp->master),
					  flags);
	file = nfd < 0 ? ERR_PTR(nfd) : close_fd_get_file(nfd);
	bunshin_files_back(own);
	if (!file)
		file = ERR_PTR(-EBADF);
	if (IS_ERR(file)) {
		pr_info("tree fork: source pid %d: fd %u is a pty slave (%s) that cannot be opened again in the target: error %ld\n",
			pid, fd, tp->src->link->name, PTR_ERR(file));
		return file;
	}
	return bunshin_tree_add(t, pid, fd, old, file, true);
}

/* What replaces the source file old, an end of a Unix98 pty pair. */
static struct file *bunshin_tree_pty(struct bunshin_tree *t, pid_t pid,
				     unsigned int fd, struct file *old)
{
	struct tty_struct *tty = bunshin_pty_of(old);
	bool master = tty->driver->subtype == PTY_TYPE_MASTER;
	struct bunshin_tree_pty *tp;
	struct bunshin_tree_map *m;

	if (tty_hung_up_p(old)) {
		pr_info("tree fork: source pid %d: fd %u is a pty (%s) that was hung up: the fork is refused\n",
			pid, fd, tty->name);
		return ERR_PTR(-EINVAL);
	}
	tp = bunshin_tree_new_pty(t, pid, fd, master ? tty : tty->link);
	if (IS_ERR(tp))
		return ERR_CAST(tp);
	if (!master)
		return bunshin_tree_pty_slave(t, pid, fd, old, tp);
	m = bunshin_tree_lookup(t, old);
	if (!m) {
		pr_info("tree fork: source pid %d: fd %u is a second open file of a pty master: the fork is refused\n",
			pid, fd);
		return ERR_PTR(-EINVAL);
	}
	m->seen = true;
	return get_file(m->dst);
}

/* Whether an open file of tty is not one the tree holds. */
static bool bunshin_tty_outside(struct bunshin_tree *t, struct tty_struct *tty)
{
	struct tty_file_private *priv;
	struct bunshin_tree_map *m;
	bool outside = false;

	spin_lock(&tty->files_lock);
	list_for_each_entry(priv, &tty->tty_files, list) {
		m = bunshin_tree_lookup(t, priv->file);
		if (!m || !m->seen) {
			outside = true;
			break;
		}
	}
	spin_unlock(&tty->files_lock);
	return outside;
}

/*
 * Every open file of the pair is the tree's (a /dev/tty open of the slave
 * too); then what the source pair has set that the opens could not (the
 * master's lock, TIOCEXCL, a closed slave) and its session and foreground
 * group, for the clones' controlling tty.
 */
static int bunshin_tree_pty_check(struct bunshin_tree *t,
				  struct bunshin_tree_pty *tp)
{
	struct tty_struct *slave = tp->src->link;
	struct tty_struct *mtty = bunshin_pty_of(tp->master);
	unsigned long flags;
	bool unused;

	if (bunshin_tty_outside(t, slave) || bunshin_tty_outside(t, tp->src)) {
		pr_info("tree fork: source pid %d: fd %u is a pty (%s) that a process outside the tree holds open: the fork is refused\n",
			tp->pid, tp->fd, slave->name);
		return -EINVAL;
	}
	if (test_bit(TTY_PTY_LOCK, &tp->src->flags))
		set_bit(TTY_PTY_LOCK, &mtty->flags);
	if (test_bit(TTY_EXCLUSIVE, &slave->flags))
		set_bit(TTY_EXCLUSIVE, &mtty->link->flags);
	/* A master whose slave was closed reads EIO until it is opened. */
	spin_lock(&mtty->link->files_lock);
	unused = list_empty(&mtty->link->tty_files);
	spin_unlock(&mtty->link->files_lock);
	if (unused && test_bit(TTY_OTHER_CLOSED, &tp->src->flags))
		set_bit(TTY_OTHER_CLOSED, &mtty->flags);
	spin_lock_irqsave(&slave->ctrl.lock, flags);
	tp->sid = get_pid(slave->ctrl.session);
	tp->pgrp = get_pid(slave->ctrl.pgrp);
	spin_unlock_irqrestore(&slave->ctrl.lock, flags);
	return 0;
}

/* What replaces the source file old at fd: a reference or an ERR_PTR. */
static struct file *bunshin_tree_file(struct bunshin_tree *t, pid_t pid,
				      unsigned int fd, struct file *old,
				      const struct path *src_root)
{
	struct bunshin_tree_map *m = bunshin_tree_lookup(t, old);
	struct inode *inode = file_inode(old);
	const char *kind, *name;
	struct file *file;
	char kbuf[64];
	bool ok;
	int err;

	if (m) {
		m->seen = true;
		return get_file(m->dst);
	}
	kind = bunshin_file_kind(old, kbuf, sizeof(kbuf), &ok);
	if (S_ISFIFO(inode->i_mode) && (old->f_mode & FMODE_PATH))
		ok = true;	/* an O_PATH reference: reopened as one */
	if (ok) {
		file = bunshin_reopen(old, src_root, &t->root, t->buf, &name);
		if (IS_ERR(file)) {
			err = PTR_ERR(file);
			pr_info("tree fork: source pid %d: fd %u is a %s (%s) that cannot be reopened in the target: error %d\n",
				pid, fd, kind, name ?: "outside the source's root",
				err);
			return ERR_PTR(err == -EXDEV ? -EINVAL : err);
		}
		return bunshin_tree_add(t, pid, fd, old, file, true);
	}
	if (S_ISFIFO(inode->i_mode) && inode->i_sb->s_magic == PIPEFS_MAGIC)
		return bunshin_tree_pipe_end(t, pid, fd, old);
	if (S_ISFIFO(inode->i_mode))
		return bunshin_tree_fifo(t, pid, fd, old, src_root);
	if (S_ISSOCK(inode->i_mode))
		return bunshin_tree_unix(t, pid, fd, old);
	if (bunshin_ksyms.ptm_open_peer && bunshin_pty_of(old))
		return bunshin_tree_pty(t, pid, fd, old);
	if (bunshin_is_tty(inode)) {
		snprintf(kbuf, sizeof(kbuf), "tty (character device %u:%u)",
			 MAJOR(inode->i_rdev), MINOR(inode->i_rdev));
		kind = kbuf;
	}
	pr_info("tree fork: source pid %d: fd %u is a %s: this kind is not carried over, the fork is refused\n",
		pid, fd, kind);
	return ERR_PTR(-EINVAL);
}

/* The substitution of the source at index for fd, or NULL. */
static struct bunshin_tree_subst_k *
bunshin_tree_find_subst(struct bunshin_tree *t, unsigned int index,
			unsigned int fd)
{
	unsigned int i;

	for (i = 0; i < t->subst_count; i++)
		if (t->subst[i].index == index && t->subst[i].fd == fd)
			return &t->subst[i];
	return NULL;
}

/* The clone's fd table for one source; runs with the source's creds. */
static int bunshin_tree_table(struct bunshin_tree *t,
			      struct bunshin_tree_proc *pr)
{
	pid_t pid = task_pid_nr(pr->source);
	struct bunshin_tree_subst_k *sub;
	struct files_struct *src, *files;
	struct file *old, *file;
	struct path src_root;
	unsigned int fd = 0;
	bool cloexec;
	int err = 0;

	src = bunshin_task_files(pr->source, &src_root);
	if (IS_ERR(src))
		return PTR_ERR(src);
	files = bunshin_dup_files(src);
	bunshin_ksyms.put_files_struct(src);
	if (IS_ERR(files)) {
		path_put(&src_root);
		return PTR_ERR(files);
	}
	t->table = files;
	for (; (old = bunshin_next_file(files, &fd, &cloexec)); fd++) {
		sub = bunshin_tree_find_subst(t, pr - t->procs, fd);
		if (sub) {
			sub->used = true;
			file = get_file(sub->file);
		} else {
			file = bunshin_tree_file(t, pid, fd, old, &src_root);
		}
		fput(old);
		if (IS_ERR(file)) {
			err = PTR_ERR(file);
			break;
		}
		bunshin_tree_set_fd(files, fd, file);
	}
	t->table = NULL;
	path_put(&src_root);
	if (err) {
		bunshin_ksyms.put_files_struct(files);
		return err;
	}
	pr->files = files;
	return 0;
}

/* Every pipe, socket pair and pty pair has all its ends in the tree. */
static int bunshin_tree_check(struct bunshin_tree *t)
{
	struct bunshin_tree_pty *tpty;
	struct bunshin_tree_pipe *tp;
	struct bunshin_tree_map *m;
	unsigned int r, w, i;
	int bkt, err;

	list_for_each_entry(tp, &t->pipes, node) {
		pipe_lock(tp->src);
		r = tp->src->readers;
		w = tp->src->writers;
		pipe_unlock(tp->src);
		if (r != tp->n[0] || w != tp->n[1]) {
			pr_info("tree fork: source pid %d: fd %u is a pipe with %u readers and %u writers, %u and %u of them in the tree: the fork is refused\n",
				tp->pid, tp->fd, r, w, tp->n[0], tp->n[1]);
			return -EINVAL;
		}
	}
	for (i = 0; i < t->subst_count; i++) {
		if (!t->subst[i].used) {
			pr_info("tree fork: source pid %d has no fd %u to substitute: the fork is refused\n",
				task_pid_nr(t->procs[t->subst[i].index].source),
				t->subst[i].fd);
			return -EINVAL;
		}
	}
	hash_for_each(t->files, bkt, m, node) {
		if (!m->seen) {
			pr_info("tree fork: source pid %d: fd %u is %s is not in the tree: the fork is refused\n",
				m->pid, m->fd,
				m->unseen ?: "a unix socket whose peer");
			return -EINVAL;
		}
	}
	list_for_each_entry(tpty, &t->ptys, node) {
		err = bunshin_tree_pty_check(t, tpty);
		if (err)
			return err;
	}
	return 0;
}

/* --- memory accounting ------------------------------------------------ */

#ifdef CONFIG_MEMCG
/* The clones' memory cgroup (NULL: not known). */
static struct mem_cgroup *bunshin_tree_memcg(struct bunshin_tree *t)
{
	return t->memcg_css ? mem_cgroup_from_css(t->memcg_css) : NULL;
}

/* Charge what current allocates to the memory cgroup of cgroup_fd. */
static struct mem_cgroup *bunshin_tree_charge(struct bunshin_tree *t, int fd)
{
	struct cgroup *cgrp = cgroup_get_from_fd(fd);

	if (IS_ERR(cgrp))
		return NULL;
	t->memcg_css = cgroup_get_e_css(cgrp, &memory_cgrp_subsys);
	cgroup_put(cgrp);
	return set_active_memcg(mem_cgroup_from_css(t->memcg_css));
}

static void bunshin_tree_uncharge(struct mem_cgroup *old)
{
	set_active_memcg(old);
}

static struct mem_cgroup *bunshin_tree_charge_to(struct mem_cgroup *memcg)
{
	return memcg ? set_active_memcg(memcg) : NULL;
}
#else
static struct mem_cgroup *bunshin_tree_charge(struct bunshin_tree *t, int fd)
{
	return NULL;
}

static void bunshin_tree_uncharge(struct mem_cgroup *old)
{
}

static struct mem_cgroup *bunshin_tree_charge_to(struct mem_cgroup *memcg)
{
	return NULL;
}

static struct mem_cgroup *bunshin_tree_memcg(struct bunshin_tree *t)
{
	return NULL;
}
#endif

/* --- phase 2: the forks, in the sources' contexts ----------------------- */

/* Runs in the source's context (task_work). */
static int bunshin_tree_fork_here(struct bunshin_tree *t,
				  struct bunshin_tree_proc *pr)
{
	struct bunshin_ksyms *k = &bunshin_ksyms;
	struct user_namespace *user_ns = t->pid_ns->user_ns;
	const struct cred *own_cred;
	struct kernel_clone_args args;
	kernel_cap_t cap_effective;
	struct cred *raised;
	struct nsproxy *new_ns, *old_ns;
	struct mem_cgroup *old_memcg;
	struct files_struct *own;
	struct task_struct *p = NULL;
	struct tty_struct *tty;
	struct path root, pwd;
	u64 start = ktime_get_ns();
	pid_t nr = pr->nr;
	int cgroup_fd, err = 0;

	if (current->flags & PF_EXITING)
		return -ESRCH;
	if (!thread_group_empty(current)) {
		pr_info("tree fork: source pid %d is multi-threaded\n",
			task_pid_nr(current));
		return -EINVAL;
	}
	if (!bunshin_cgroup_frozen(current))
		return -EBUSY;

	/*
	 * The caller (CAP_SYS_ADMIN) asks for the clone's cgroup and pid: the
	 * kernel's checks of both (CLONE_INTO_CGROUP's write access to
	 * cgroup.procs, set_tid's CAP_CHECKPOINT_RESTORE) are made with the
	 * source's credentials with those capabilities raised; the child's
	 * copy of them gets the source's effective set back before it runs.
	 */
	raised = prepare_creds();
	if (!raised)
		return -ENOMEM;
	cap_effective = raised->cap_effective;
	cap_raise(raised->cap_effective, CAP_DAC_OVERRIDE);
	cap_raise(raised->cap_effective, CAP_SYS_ADMIN);
	cap_raise(raised->cap_effective, CAP_CHECKPOINT_RESTORE);
	own_cred = override_creds(raised);

	/*
	 * The root clone of a new pid namespace is its init: pid 1. A clone
	 * whose pid is taken in the target gets one no other source has, so
	 * that it takes no pid a later clone could keep.
	 */
	if (t->new_init && pr == t->procs)
		nr = 0;
	rcu_read_lock();
	while (nr && find_pid_ns(nr, t->pid_ns))
		nr = nr == pr->nr ? t->spare : ++t->spare;
	if (nr && nr != pr->nr)
		t->spare = nr + 1;
	rcu_read_unlock();
	/* alloc_pid() checks this for set_tid (only another user ns lacks it). */
	if (nr && !ns_capable_noaudit(user_ns, CAP_CHECKPOINT_RESTORE) &&
	    !ns_capable_noaudit(user_ns, CAP_SYS_ADMIN)) {
		pr_info("tree fork: source pid %d lacks CAP_CHECKPOINT_RESTORE in the target's pid namespace: its clone gets another pid\n",
			task_pid_nr(current));
		nr = 0;
	}

	own = bunshin_files_in(pr->files);	/* the clone's table */
	cgroup_fd = get_unused_fd_flags(O_CLOEXEC);
	if (cgroup_fd < 0) {
		err = cgroup_fd;
		goto swap_back;
	}
	fd_install(cgroup_fd, get_file(t->cgroup_file));

	task_lock(t->target);
	new_ns = t->target->nsproxy;
	if (!new_ns || new_ns->pid_ns_for_children != t->pid_ns) {
		task_unlock(t->target);
		err = new_ns ? -EINVAL : -ESRCH;
		goto close;
	}
	get_nsproxy(new_ns);
	task_unlock(t->target);

	bunshin_leave_frozen();
	old_ns = current->nsproxy;
	get_nsproxy(old_ns);
	k->switch_task_namespaces(current, new_ns);	/* takes our new_ns ref */
	/* The child's kernel memory (page tables, ...) is the clones' cgroup's. */
	old_memcg = bunshin_tree_charge_to(bunshin_tree_memcg(t));
	for (;;) {
		memset(&args, 0, sizeof(args));
		args.flags = CLONE_FILES | CLONE_INTO_CGROUP;
		args.cgroup = cgroup_fd;
		args.exit_signal = pr->exit_signal;
		if (nr) {
			args.set_tid = &nr;
			args.set_tid_size = 1;
		}
		p = k->copy_process(NULL, 0, NUMA_NO_NODE, &args);
		if (!nr || !IS_ERR(p) ||
		    (PTR_ERR(p) != -EEXIST && PTR_ERR(p) != -EINVAL))
			break;
		nr = 0;		/* taken since we looked, or above pid_max */
	}
	bunshin_tree_uncharge(old_memcg);
	k->switch_task_namespaces(current, old_ns);	/* takes our old_ns ref */
	bunshin_refreeze();

close:
	close_fd(cgroup_fd);	/* the clone shares the table: it loses it too */
swap_back:
	bunshin_files_back(own);	/* pr->files keeps its reference */
	revert_creds(own_cred);
	put_cred(raised);
	if (err)
		return err;
	if (IS_ERR(p)) {
		err = PTR_ERR(p);
		if (err != -ERESTARTNOINTR)
			pr_info("tree fork: source pid %d: cannot fork into the target (cgroup, pid namespace): error %d\n",
				task_pid_nr(current), err);
		/* A signal is pending: fork() would restart, we cannot. */
		return err == -ERESTARTNOINTR ? -EAGAIN : err;
	}

	/*
	 * copy_creds() gave the child its own copy of the raised credentials
	 * (no other task has it, the child never ran): lower them again.
	 */
	((struct cred *)p->real_cred)->cap_effective = cap_effective;
	((struct cred *)p->cred)->cap_effective = cap_effective;
	root = t->root;
	pwd = t->pwd;
	path_get(&root);
	path_get(&pwd);
	bunshin_set_child_fs(p, &root, &pwd);
	bunshin_child_resume_here(p);
	/*
	 * No controlling tty until adoption, which gives the clone the new
	 * pair's slave if it replaces the source's (the reference it had,
	 * the source's, is kept for that).
	 */
	spin_lock_irq(&p->sighand->siglock);
	tty = p->signal->tty;
	p->signal->tty = NULL;
	spin_unlock_irq(&p->sighand->siglock);
	pr->tty = tty;
	pr->clone = get_task_struct(p);
	pr->ns = ktime_get_ns() - start;
	/* Another request made the init meanwhile: this clone is killed. */
	if (t->new_init && pr == t->procs && task_pid_nr_ns(p, t->pid_ns) != 1)
		return -EBUSY;
	return 0;
}

/*
 * One fork request queued on a source, shared by the caller and the
 * task_work (one reference each). tree and proc are used only while the
 * caller waits: once cancelled, the work does nothing but drop its
 * reference.
 */
struct bunshin_tree_work {
	struct callback_head twork;
	refcount_t refs;
	atomic_t state;
	struct completion done;
	struct bunshin_tree *tree;
	struct bunshin_tree_proc *proc;
	int error;
};

static void bunshin_tree_work_put(struct bunshin_tree_work *w)
{
	if (refcount_dec_and_test(&w->refs))
		kfree(w);
}

static void bunshin_tree_twork(struct callback_head *head)
{
	struct bunshin_tree_work *w =
		container_of(head, struct bunshin_tree_work, twork);

	if (atomic_cmpxchg(&w->state, BUNSHIN_TREE_QUEUED,
			   BUNSHIN_TREE_RUNNING) == BUNSHIN_TREE_QUEUED) {
		w->error = bunshin_tree_fork_here(w->tree, w->proc);
		complete(&w->done);
	}
	bunshin_tree_work_put(w);
	module_put(THIS_MODULE);
}

/* Make the source of pr fork its clone, and wait for it. */
static int bunshin_tree_run(struct bunshin_tree *t,
			    struct bunshin_tree_proc *pr)
{
	struct bunshin_tree_work *w = kzalloc(sizeof(*w), GFP_KERNEL);
	long left;
	int err;

	if (!w)
		return -ENOMEM;
	refcount_set(&w->refs, 2);	/* ours and the work's */
	atomic_set(&w->state, BUNSHIN_TREE_QUEUED);
	init_completion(&w->done);
	init_task_work(&w->twork, bunshin_tree_twork);
	w->tree = t;
	w->proc = pr;

	__module_get(THIS_MODULE);
	err = task_work_add(pr->source, &w->twork, TWA_SIGNAL);
	if (err) {
		module_put(THIS_MODULE);
		kfree(w);
		return err;
	}
	left = wait_for_completion_killable_timeout(&w->done,
						    BUNSHIN_TREE_TIMEOUT);
	if (left <= 0) {
		if (atomic_cmpxchg(&w->state, BUNSHIN_TREE_QUEUED,
				   BUNSHIN_TREE_CANCELLED) ==
		    BUNSHIN_TREE_QUEUED) {
			err = left ? -EINTR : -ETIMEDOUT;
			if (!left)
				pr_info("tree fork: source pid %d did not run its fork in time\n",
					task_pid_nr(pr->source));
			goto put;
		}
		wait_for_completion(&w->done);	/* running: it ends soon */
	}
	err = w->error;
put:
	bunshin_tree_work_put(w);
	return err;
}

/* --- phase 3: adoption ------------------------------------------------- */

/* The clone of the source whose pid (in the sources' namespace) is nr. */
static struct pid *bunshin_tree_map_pid(struct bunshin_tree *t, pid_t nr)
{
	unsigned int i;

	for (i = 0; nr && i < t->made; i++)
		if (t->procs[i].nr == nr)
			return task_pid(t->procs[i].clone);
	return NULL;
}

/*
 * Sessions and process groups mapped through the tree; one led by a process
 * outside it maps to the root clone's session (the root clone leads a new
 * one if its own session leader is outside). tasklist_lock held.
 */
static void bunshin_tree_sessions(struct bunshin_tree *t)
{
	struct pid *root_sid, *sid, *pgrp;
	struct bunshin_tree_proc *pr;
	unsigned int i;

	root_sid = bunshin_tree_map_pid(t, t->procs[0].sid_nr) ?:
		   task_pid(t->procs[0].clone);
	for (i = 0; i < t->made; i++) {
		pr = &t->procs[i];
		sid = bunshin_tree_map_pid(t, pr->sid_nr) ?: root_sid;
		pgrp = bunshin_tree_map_pid(t, pr->pgid_nr) ?: sid;
		bunshin_ksyms.change_pid(pr->clone, PIDTYPE_SID, sid);
		bunshin_ksyms.change_pid(pr->clone, PIDTYPE_PGID, pgrp);
		pr->clone->signal->leader = sid == task_pid(pr->clone);
		pr->clone->signal->is_child_subreaper = pr->subreaper;
	}
}

/*
 * SO_PEERCRED of the new sockets: the source's credentials, and the clone of
 * the process the source names (none if that is not in the tree), not the
 * caller, who made the pairs.
 */
static void bunshin_tree_peercred(struct bunshin_tree *t)
{
	const struct cred *cred, *old_cred;
	struct pid *pid, *mapped, *old_pid;
	struct bunshin_tree_sock *ts;
	unsigned int i;

	list_for_each_entry(ts, &t->socks, node) {
		spin_lock(&ts->src->sk_peer_lock);
		pid = get_pid(ts->src->sk_peer_pid);
		cred = ts->src->sk_peer_cred ? get_cred(ts->src->sk_peer_cred) :
					       NULL;
		spin_unlock(&ts->src->sk_peer_lock);
		mapped = NULL;
		for (i = 0; pid && i < t->made; i++) {
			if (task_tgid(t->procs[i].source) == pid) {
				mapped = get_pid(task_tgid(t->procs[i].clone));
				break;
			}
		}
		put_pid(pid);
		spin_lock(&ts->dst->sk_peer_lock);
		old_pid = ts->dst->sk_peer_pid;
		old_cred = ts->dst->sk_peer_cred;
		ts->dst->sk_peer_pid = mapped;
		ts->dst->sk_peer_cred = cred;
		spin_unlock(&ts->dst->sk_peer_lock);
		put_pid(old_pid);
		if (old_cred)
			put_cred(old_cred);
	}
}

/* The clone of the source whose pid is pid (a source's), or NULL. */
static struct task_struct *bunshin_tree_clone_of(struct bunshin_tree *t,
						 struct pid *pid)
{
	unsigned int i;

	for (i = 0; pid && i < t->made; i++)
		if (task_pid(t->procs[i].source) == pid)
			return t->procs[i].clone;
	return NULL;
}

/*
 * Controlling ttys: a new pair's slave is the controlling tty of the clones'
 * session if the source slave was the sources' (its session leader in the
 * tree), with the clone of its foreground group as foreground group (the
 * session's if that is not in the tree), and of every clone in the session
 * whose source had it: what TIOCSCTTY and fork() make. The new tty has
 * never been used by a task (no task runs with it before the clones are
 * woken). tasklist_lock held, after bunshin_tree_sessions().
 */
static void bunshin_tree_ctty(struct bunshin_tree *t)
{
	struct task_struct *leader, *fg, *p;
	struct tty_struct *tty, *old;
	struct bunshin_tree_pty *tp;
	struct pid *sid;
	unsigned int i;

	list_for_each_entry(tp, &t->ptys, node) {
		leader = bunshin_tree_clone_of(t, tp->sid);
		if (!leader)
			continue;
		sid = task_pid(leader);
		fg = bunshin_tree_clone_of(t, tp->pgrp);
		tty = bunshin_pty_of(tp->master)->link;
		spin_lock(&tty->ctrl.lock);
		put_pid(tty->ctrl.session);
		put_pid(tty->ctrl.pgrp);
		tty->ctrl.session = get_pid(sid);
		tty->ctrl.pgrp = get_pid(fg ? task_pgrp(fg) : sid);
		spin_unlock(&tty->ctrl.lock);
		for (i = 0; i < t->made; i++) {
			p = t->procs[i].clone;
			if (t->procs[i].tty != tp->src->link ||
			    task_session(p) != sid)
				continue;
			spin_lock(&p->sighand->siglock);
			old = p->signal->tty;
			p->signal->tty = tty_kref_get(tty);
			spin_unlock(&p->sighand->siglock);
			tty_kref_put(old);
		}
	}
}

/*
 * Move every clone under its parent (the clone of its source's parent) and,
 * if all went well, into its session and group; then wake them all, killed
 * first if anything failed (err, or a parent gone). Returns the error.
 */
static int bunshin_tree_finish(struct bunshin_tree *t, int err)
{
	struct bunshin_ksyms *k = &bunshin_ksyms;
	struct task_struct *p, *parent, *fallback;
	struct bunshin_tree_proc *pr;
	unsigned int i;

	if (!t->made)
		return err;
	write_lock_irq(k->tasklist_lock);
	/* A killed clone whose parent is gone is reaped by our init. */
	fallback = task_active_pid_ns(current)->child_reaper;
	for (i = 0; i < t->made; i++) {
		pr = &t->procs[i];
		p = pr->clone;
		parent = i ? t->procs[pr->parent].clone : t->reaper;
		/*
		 * exit_notify() hands the children on and sets exit_state in
		 * one tasklist_lock section: with exit_state still 0 the
		 * parent's exit, if it comes, will see this child.
		 */
		if (parent->exit_state || (parent->flags & PF_EXITING)) {
			if (!err)
				err = -ESRCH;
			parent = fallback;
		}
		list_move_tail(&p->sibling, &parent->children);
		p->real_parent = parent;
		p->parent = parent;
		p->parent_exec_id = parent->self_exec_id;
		p->signal->has_child_subreaper =
			parent->signal->has_child_subreaper ||
			parent->signal->is_child_subreaper;
	}
	if (!err) {
		bunshin_tree_sessions(t);
		bunshin_tree_ctty(t);
	}
	write_unlock_irq(k->tasklist_lock);
	if (!err)
		bunshin_tree_peercred(t);

	for (i = 0; i < t->made; i++) {
		p = t->procs[i].clone;
		if (err)
			send_sig(SIGKILL, p, 1);	/* dies unseen */
		k->wake_up_new_task(p);
	}
	return err;
}

/* --- the request ------------------------------------------------------- */

static void bunshin_tree_free(struct bunshin_tree *t)
{
	struct bunshin_tree_pty *tpty, *tpty_tmp;
	struct bunshin_tree_sock *ts, *ts_tmp;
	struct bunshin_tree_pipe *tp, *tmp;
	struct bunshin_tree_map *m;
	struct hlist_node *next;
	unsigned int i;
	int bkt;

	for (i = 0; t->procs && i < t->count; i++) {
		struct bunshin_tree_proc *pr = &t->procs[i];

		if (pr->clone)
			put_task_struct(pr->clone);
		if (pr->files)
			bunshin_ksyms.put_files_struct(pr->files);
		if (pr->cred)
			put_cred(pr->cred);
		tty_kref_put(pr->tty);
		if (pr->source)
			put_task_struct(pr->source);
	}
	hash_for_each_safe(t->files, bkt, next, m, node) {
		fput(m->src);
		fput(m->dst);
		kfree(m);
	}
	list_for_each_entry_safe(ts, ts_tmp, &t->socks, node)
		kfree(ts);
	list_for_each_entry_safe(tpty, tpty_tmp, &t->ptys, node) {
		if (tpty->master)
			fput(tpty->master);
		tty_kref_put(tpty->src);
		put_pid(tpty->sid);
		put_pid(tpty->pgrp);
		kfree(tpty);
	}
	list_for_each_entry_safe(tp, tmp, &t->pipes, node) {
		if (tp->end[0])
			fput(tp->end[0]);
		if (tp->end[1])
			fput(tp->end[1]);
		kfree(tp);
	}
	for (i = 0; t->subst && i < t->subst_count; i++)
		if (t->subst[i].file)
			fput(t->subst[i].file);
	kfree(t->subst);
	if (t->net)
		put_net(t->net);
	if (t->root.mnt) {
		path_put(&t->root);
		path_put(&t->pwd);
	}
	if (t->cgroup_file)
		fput(t->cgroup_file);
#ifdef CONFIG_MEMCG
	if (t->memcg_css)
		css_put(t->memcg_css);
#endif
	if (t->pid_ns)
		put_pid_ns(t->pid_ns);
	if (t->reaper)
		put_task_struct(t->reaper);
	if (t->target)
		put_task_struct(t->target);
	kfree(t->buf);
	kfree(t->procs);
	kfree(t);
}

/*
 * The target, its namespaces, root and cwd, and the root clone's parent:
 * the init of the target's pid namespace, or the target itself if its pid
 * namespace for children is new and empty (the root clone becomes its init).
 */
static int bunshin_tree_target(struct bunshin_tree *t, int pidfd)
{
	struct pid_namespace *ns, *active;
	struct task_struct *target, *reaper = NULL;
	unsigned int fflags;
	struct pid *pid;
	int err = 0;

	if (pidfd < 0)
		return -EBADF;
	pid = bunshin_ksyms.pidfd_get_pid(pidfd, &fflags);
	if (IS_ERR(pid))
		return PTR_ERR(pid);
	target = get_pid_task(pid, PIDTYPE_PID);
	put_pid(pid);
	if (!target)
		return -ESRCH;
	t->target = target;
	if (target->flags & PF_KTHREAD)
		return -EINVAL;

	rcu_read_lock();
	task_lock(target);
	active = task_active_pid_ns(target);
	if (!target->nsproxy || !target->fs || !active) {
		err = -ESRCH;
	} else {
		ns = target->nsproxy->pid_ns_for_children;
		t->pid_ns = get_pid_ns(ns);
		t->net = get_net(target->nsproxy->net_ns);
		get_fs_root(target->fs, &t->root);
		get_fs_pwd(target->fs, &t->pwd);
		if (ns == active) {
			reaper = ns->child_reaper;
		} else if (ns->parent == active && !READ_ONCE(ns->child_reaper) &&
			   READ_ONCE(ns->pid_allocated) == PIDNS_ADDING) {
			reaper = target;
			t->new_init = true;
		} else {
			err = -EINVAL;
		}
		if (reaper)
			get_task_struct(reaper);
	}
	task_unlock(target);
	rcu_read_unlock();
	if (err == -EINVAL)
		pr_info("tree fork: the target's pid namespace for children is neither its own nor a new, empty one\n");
	if (err)
		return err;
	if (!reaper)
		return -ESRCH;
	t->reaper = reaper;
	/* The clones must be visible to the caller: report their pids. */
	return task_pid_vnr(reaper) ? 0 : -EINVAL;
}

/*
 * The fd substitutions of the request: each names a source by index and an
 * fd, and holds a reference to the caller's file.
 */
static int bunshin_tree_load_subst(struct bunshin_tree *t,
				   const struct bunshin_tree_req *req)
{
	struct bunshin_tree_subst *us;
	unsigned int i, j;
	int err = 0;

	us = memdup_user(u64_to_user_ptr(req->subst),
			 req->subst_count * sizeof(*us));
	if (IS_ERR(us))
		return PTR_ERR(us);
	t->subst = kcalloc(req->subst_count, sizeof(*t->subst), GFP_KERNEL);
	if (!t->subst) {
		err = -ENOMEM;
		goto out;
	}
	t->subst_count = req->subst_count;
	for (i = 0; i < t->subst_count; i++) {
		if (us[i].reserved || us[i].index >= t->count ||
		    us[i].fd > INT_MAX) {
			err = -EINVAL;
			goto out;
		}
		for (j = 0; j < i; j++) {
			if (us[j].index == us[i].index && us[j].fd == us[i].fd) {
				pr_info("tree fork: fd %u of source %u is substituted twice\n",
					us[i].fd, us[i].index);
				err = -EINVAL;
				goto out;
			}
		}
		t->subst[i].index = us[i].index;
		t->subst[i].fd = us[i].fd;
		t->subst[i].file = us[i].caller_fd < 0 ? NULL :
				   fget(us[i].caller_fd);
		if (!t->subst[i].file) {
			err = -EBADF;
			goto out;
		}
	}
out:
	kfree(us);
	return err;
}

/* The sources, checked: frozen, single-threaded, each parent before it. */
static int bunshin_tree_sources(struct bunshin_tree *t, const s32 *pids)
{
	struct pid_namespace *src_ns = NULL, *ns;
	struct bunshin_tree_proc *pr;
	struct task_struct *task, *parent;
	unsigned int i, j;
	struct pid *pid;
	int threads;

	for (i = 0; i < t->count; i++) {
		pr = &t->procs[i];
		pr->parent = -1;
		if (pids[i] <= 0)
			return -ESRCH;
		pid = find_get_pid(pids[i]);
		task = pid ? get_pid_task(pid, PIDTYPE_PID) : NULL;
		put_pid(pid);
		if (!task)
			return -ESRCH;
		pr->source = task;
		if ((task->flags & (PF_KTHREAD | PF_IO_WORKER)) ||
		    same_thread_group(task, current))
			return -EINVAL;
		threads = get_nr_threads(task);
		if (threads != 1) {
			pr_info("tree fork: source pid %d has %d threads: multi-threaded sources are refused\n",
				pids[i], threads);
			return -EINVAL;
		}
		if (!bunshin_cgroup_frozen(task))
			return -EBUSY;
		rcu_read_lock();
		ns = task_active_pid_ns(task);
		if (!i)
			src_ns = ns;
		parent = rcu_dereference(task->real_parent);
		for (j = 0; j < i; j++) {
			if (t->procs[j].source == task)
				break;
			if (t->procs[j].source == parent)
				pr->parent = j;
		}
		pr->nr = task_pid_nr_ns(task, src_ns);
		t->spare = max(t->spare, pr->nr + 1);
		pr->sid_nr = task_session_nr_ns(task, src_ns);
		pr->pgid_nr = task_pgrp_nr_ns(task, src_ns);
		pr->exit_signal = i ? READ_ONCE(task->exit_signal) : SIGCHLD;
		pr->subreaper = task->signal->is_child_subreaper;
		rcu_read_unlock();
		if (j < i) {
			pr_info("tree fork: source pid %d is named twice\n",
				pids[i]);
			return -EINVAL;
		}
		if (!ns || ns != src_ns) {
			pr_info("tree fork: source pid %d is not in the pid namespace of the root\n",
				pids[i]);
			return -EINVAL;
		}
		if (i && pr->parent < 0) {
			pr_info("tree fork: the parent of source pid %d is not named before it\n",
				pids[i]);
			return -EINVAL;
		}
		if (pr->exit_signal < 0 || !valid_signal(pr->exit_signal))
			pr->exit_signal = SIGCHLD;
		pr->cred = get_task_cred(task);
	}
	return 0;
}


long bunshin_ioctl_fork_tree(void __user *uarg)
{
	struct mem_cgroup *old_memcg;
	struct bunshin_tree_req req;
	const struct cred *old_cred;
	struct bunshin_tree *t;
	s32 *pids, *out = NULL;
	u64 source_ns = 0;
	size_t size;
	unsigned int i;
	int err;

	if (!capable(CAP_SYS_ADMIN))
		return -EPERM;
	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if ((req.flags & ~BUNSHIN_TREE_FLAGS) || !req.count ||
	    req.count > BUNSHIN_TREE_MAX || req.reserved0 ||
	    memchr_inv(req.reserved, 0, sizeof(req.reserved)))
		return -EINVAL;
	if (req.flags & BUNSHIN_TREE_SUBST) {
		if (!req.subst_count || req.subst_count > BUNSHIN_TREE_SUBST_MAX)
			return -EINVAL;
	} else if (req.subst || req.subst_count) {
		return -EINVAL;
	}
	/* Fail on an unwritable argument before anything is made. */
	if (copy_to_user(uarg, &req, sizeof(req)))
		return -EFAULT;
	if (!bunshin_ksyms.tree_ready)
		return -EOPNOTSUPP;

	size = req.count * sizeof(*pids);
	pids = memdup_user(u64_to_user_ptr(req.source_pids), size);
	if (IS_ERR(pids))
		return PTR_ERR(pids);
	out = kcalloc(req.count, sizeof(*out), GFP_KERNEL);
	t = kzalloc(sizeof(*t), GFP_KERNEL);
	if (!out || !t) {
		kfree(t);
		err = -ENOMEM;
		goto free_arrays;
	}
	hash_init(t->files);
	INIT_LIST_HEAD(&t->pipes);
	INIT_LIST_HEAD(&t->socks);
	INIT_LIST_HEAD(&t->ptys);
	t->count = req.count;
	t->procs = kcalloc(req.count, sizeof(*t->procs), GFP_KERNEL);
	t->buf = kmalloc(PATH_MAX, GFP_KERNEL);
	err = -ENOMEM;
	if (!t->procs || !t->buf)
		goto free_tree;
	err = -EFAULT;
	if (copy_to_user(u64_to_user_ptr(req.child_pids), out, size))
		goto free_tree;

	err = bunshin_tree_target(t, req.target_pidfd);
	if (err)
		goto free_tree;
	t->cgroup_file = bunshin_fork_cgroup(req.cgroup_fd);
	if (IS_ERR(t->cgroup_file)) {
		err = PTR_ERR(t->cgroup_file);
		t->cgroup_file = NULL;
		goto free_tree;
	}
	err = bunshin_tree_sources(t, pids);
	if (!err && (req.flags & BUNSHIN_TREE_SUBST))
		err = bunshin_tree_load_subst(t, &req);
	if (err)
		goto free_tree;

	/*
	 * Phase 1: the tables, with each source's credentials, the memory of
	 * what is made (files, pipes and their bytes, sockets) charged to the
	 * memory cgroup of the clones, not the caller's.
	 */
	old_memcg = bunshin_tree_charge(t, req.cgroup_fd);
	for (i = 0; i < t->count && !err; i++) {
		old_cred = override_creds(t->procs[i].cred);
		err = bunshin_tree_table(t, &t->procs[i]);
		revert_creds(old_cred);
	}
	bunshin_tree_uncharge(old_memcg);
	if (!err)
		err = bunshin_tree_check(t);
	if (err)
		goto free_tree;

	/* Phase 2: the forks, parents first. */
	for (i = 0; i < t->count && !err; i++) {
		err = bunshin_tree_run(t, &t->procs[i]);
		if (t->procs[i].clone) {
			t->made++;
			source_ns += t->procs[i].ns;
		}
	}

	/* Phase 3: adoption, then every clone is woken (or killed). */
	err = bunshin_tree_finish(t, err);
	if (err)
		goto free_tree;
	for (i = 0; i < t->count; i++)
		out[i] = task_pid_vnr(t->procs[i].clone);
	req.source_ns = source_ns;
	if (copy_to_user(u64_to_user_ptr(req.child_pids), out, size) ||
	    copy_to_user(uarg, &req, sizeof(req))) {
		for (i = 0; i < t->count; i++)
			send_sig(SIGKILL, t->procs[i].clone, 1);
		err = -EFAULT;
	}
free_tree:
	bunshin_tree_free(t);
free_arrays:
	kfree(out);
	kfree(pids);
	return err;
}
