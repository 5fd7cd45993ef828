// pause holds a pod's namespaces: it reaps orphans and exits on SIGINT or SIGTERM.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		for {
			var status syscall.WaitStatus
			syscall.Wait4(-1, &status, 0, nil)
		}
	}()
	<-stop
}
