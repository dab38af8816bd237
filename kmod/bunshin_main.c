// SPDX-License-Identifier: GPL-2.0
/*
 * bunshin_main.c: /dev/bunshin, the Bunshin kernel module's device.
 *
 * A misc device with a dynamic minor. Its ioctl handler is a thin switch
 * with one helper per command; the commands and their argument structures
 * are defined in include/uapi/linux/bunshin.h.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bunshin.h>
#include <linux/capability.h>
#include <linux/compat.h>
#include <linux/fs.h>
#include <linux/miscdevice.h>
#include <linux/module.h>
#include <linux/string.h>
#include <linux/uaccess.h>
#include <linux/version.h>

#include "bunshin_internal.h"

static bool bunshin_capable(void)
{
	if (capable(CAP_SYS_ADMIN))
		return true;
#if LINUX_VERSION_CODE >= KERNEL_VERSION(5, 9, 0)
	if (capable(CAP_CHECKPOINT_RESTORE))
		return true;
#endif
	return false;
}

static u64 bunshin_features(void)
{
	u64 features = BUNSHIN_FEATURE_VERSION;

	if (bunshin_ksyms.resolved)
		features |= BUNSHIN_FEATURE_FORK_SYMBOLS;
	if (bunshin_ksyms.fork_ready)
		features |= BUNSHIN_FEATURE_FORK;
	if (bunshin_ksyms.cgroup_ready)
		features |= BUNSHIN_FEATURE_FORK_CGROUP;
	if (bunshin_ksyms.session_ready)
		features |= BUNSHIN_FEATURE_FORK_SESSION;
	if (bunshin_ksyms.files_ready)
		features |= BUNSHIN_FEATURE_FORK_FILES;
	if (bunshin_ksyms.tree_ready)
		features |= BUNSHIN_FEATURE_FORK_TREE |
			    BUNSHIN_FEATURE_TREE_SUBST;
	return features;
}

static long bunshin_ioctl_version(struct bunshin_version __user *uarg)
{
	struct bunshin_version ver;

	if (copy_from_user(&ver, uarg, sizeof(ver)))
		return -EFAULT;
	if (ver.flags || ver.reserved0 ||
	    memchr_inv(ver.reserved, 0, sizeof(ver.reserved)))
		return -EINVAL;

	memset(&ver, 0, sizeof(ver));
	ver.abi_version = BUNSHIN_ABI_VERSION;
	ver.features = bunshin_features();
	ver.kernel_version = LINUX_VERSION_CODE;

	if (copy_to_user(uarg, &ver, sizeof(ver)))
		return -EFAULT;
	return 0;
}

static long bunshin_ioctl(struct file *file, unsigned int cmd,
			  unsigned long arg)
{
	void __user *uarg = (void __user *)arg;

	if (!bunshin_capable())
		return -EPERM;

	switch (cmd) {
	case BUNSHIN_IOC_VERSION:
		return bunshin_ioctl_version(uarg);
	case BUNSHIN_IOC_FORK:
		return bunshin_ioctl_fork(uarg);
	case BUNSHIN_IOC_FORK_TREE:
		return bunshin_ioctl_fork_tree(uarg);
	default:
		return -ENOTTY;
	}
}

static const struct file_operations bunshin_fops = {
	.owner = THIS_MODULE,
	.unlocked_ioctl = bunshin_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.llseek = noop_llseek,
};

static struct miscdevice bunshin_miscdev = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "bunshin",
	.fops = &bunshin_fops,
	.mode = 0600,
};

static int __init bunshin_init(void)
{
	int ret;

	if (bunshin_ksyms_init())
		pr_info("fork internals not resolved: the fork command is off\n");

	ret = misc_register(&bunshin_miscdev);
	if (ret) {
		pr_err("cannot register /dev/bunshin: %d\n", ret);
		return ret;
	}
	return 0;
}

static void __exit bunshin_exit(void)
{
	misc_deregister(&bunshin_miscdev);
}

module_init(bunshin_init);
module_exit(bunshin_exit);

MODULE_DESCRIPTION("Bunshin: live copy-on-write forks of container workspaces");
MODULE_AUTHOR("The Bunshin authors");
/* GPL: register_kprobe() and the fork internals are GPL-only. */
MODULE_LICENSE("GPL");
