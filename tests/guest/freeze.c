/*
 * A hostile guest program for the tests (issue 17): it freezes the guest agent the way a broken
 * or hostile guest can, so the host's watchdog must notice.
 *
 *   freeze stop-agent   every thread of PID 1 (the agent) is stopped with SIGSTOP, delivered
 *                       through ptrace (the kernel protects init from a plain kill -STOP), and
 *                       kept stopped by this process, which then sleeps forever.
 *
 * It returns at once and does its work in a detached child (new session, no inherited output),
 * so the exec that started it ends normally first.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <unistd.h>

static void detach_from_exec(void) {
    if (fork() != 0)
        _exit(0);
    setsid();
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
    }
    /* Let the agent report the exec's end before it freezes. */
    sleep(1);
}

static int stop_agent(void) {
    DIR *d = opendir("/proc/1/task");
    if (!d) {
        perror("/proc/1/task");
        return 1;
    }
    /* Check access before detaching, so a refusal is reported to the test. */
    detach_from_exec();
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int tid = atoi(e->d_name);
        if (tid > 0)
            ptrace(PTRACE_ATTACH, tid, 0, 0);
    }
    closedir(d);
    for (;;)
        pause();
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "stop-agent") == 0)
        return stop_agent();
    fprintf(stderr, "usage: freeze stop-agent\n");
    return 2;
}
