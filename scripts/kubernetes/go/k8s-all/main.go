// k8s-all is one binary for the Kubernetes components the test cluster runs, chosen by the name it
// is called by (a symlink) or by its first argument. One binary links the shared packages once,
// which roughly halves the cold build on a small machine.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
	_ "time/tzdata"
)

func main() {
	name := filepath.Base(os.Args[0])
	if name == "k8s-all" && len(os.Args) > 1 {
		name, os.Args = os.Args[1], os.Args[1:]
	}
	var command *cobra.Command
	switch name {
	case "kube-apiserver":
		command = apiserver.NewAPIServerCommand()
	case "kube-controller-manager":
		command = controllermanager.NewControllerManagerCommand()
	case "kube-scheduler":
		command = scheduler.NewSchedulerCommand()
	case "kubelet":
		command = kubelet.NewKubeletCommand(context.Background())
	case "kube-proxy":
		command = proxy.NewProxyCommand()
	case "kubectl":
		logs.GlogSetter(kubectl.GetLogVerbosity(os.Args)) //nolint:errcheck
		if err := cli.RunNoErrOutput(kubectl.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
		return
	default:
		fmt.Fprintln(os.Stderr, "usage: k8s-all {kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy|kubectl} ARGS...")
		os.Exit(2)
	}
	os.Exit(cli.Run(command))
}
