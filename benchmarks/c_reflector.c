/* A UDP reflector in C: the machine's I/O limit for benchmarks/aggregator.py.
 *
 * Binds 127.0.0.1 on an ephemeral port (or argv[1]), prints "listening on 127.0.0.1:PORT", then
 * sends every datagram straight back to its sender: recvmmsg of up to 256 datagrams (blocking for
 * the first), one sendmmsg of the batch. No aggregation logic: what is left of the aggregator's cost
 * next to it is the aggregator's. Stops on SIGTERM or SIGINT.
 *
 *   cc -O2 -o c_reflector benchmarks/c_reflector.c   (benchmarks/aggregator.py does this itself)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define BATCH 256
#define STRIDE 9216

static volatile sig_atomic_t stop;

static void on_signal(int sig) { (void)sig; stop = 1; }

int main(int argc, char **argv) {
    static unsigned char buf[BATCH][STRIDE];
    static struct sockaddr_in addr[BATCH];
    static struct iovec iov[BATCH];
    static struct mmsghdr rx[BATCH], tx[BATCH];
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal; /* no SA_RESTART: a blocked recvmmsg returns EINTR */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    int size = 8 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(argc > 1 ? atoi(argv[1]) : 0)};
    me.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof me;
    if (fd < 0 || bind(fd, (struct sockaddr *)&me, sizeof me) < 0 ||
        getsockname(fd, (struct sockaddr *)&me, &len) < 0) {
        perror("c_reflector");
        return 1;
    }
    printf("listening on 127.0.0.1:%d\n", ntohs(me.sin_port));
    fflush(stdout);

    for (int i = 0; i < BATCH; i++) {
        iov[i].iov_base = buf[i];
        iov[i].iov_len = STRIDE;
        rx[i].msg_hdr.msg_iov = &iov[i];
        rx[i].msg_hdr.msg_iovlen = 1;
        rx[i].msg_hdr.msg_name = &addr[i];
        tx[i] = rx[i];
    }
    while (!stop) {
        for (int i = 0; i < BATCH; i++) {
            rx[i].msg_hdr.msg_namelen = sizeof addr[i];
            iov[i].iov_len = STRIDE;
        }
        int n = recvmmsg(fd, rx, BATCH, MSG_WAITFORONE, NULL);
        if (n <= 0)
            continue; /* EINTR (a signal) or an error: look at stop */
        for (int i = 0; i < n; i++) {
            iov[i].iov_len = rx[i].msg_len;
            tx[i].msg_hdr.msg_namelen = rx[i].msg_hdr.msg_namelen;
        }
        for (int done = 0; done < n;) {
            int r = sendmmsg(fd, tx + done, n - done, 0);
            if (r < 0) {
                if (errno == EINTR)
                    continue;
                break; /* a full buffer drops the rest, as a switch would */
            }
            done += r;
        }
    }
    close(fd);
    return 0;
}
