// dra-grpc-probe: calls a DRA kubelet plugin socket like the kubelet does
// (NodePrepareResources / NodeUnprepareResources, v1 or v1beta1).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	drav1 "k8s.io/kubelet/pkg/apis/dra/v1"
	drav1beta1 "k8s.io/kubelet/pkg/apis/dra/v1beta1"
)

func main() {
	sock := flag.String("socket", "", "path to dra.sock")
	ns := flag.String("namespace", "default", "claim namespace")
	name := flag.String("name", "claim1", "claim name")
	uid := flag.String("uid", "uid-claim1", "claim UID")
	api := flag.String("api", "v1", "v1 or v1beta1")
	n := flag.Int("n", 1, "prepare+unprepare iterations")
	flag.Parse()
	conn, err := grpc.NewClient("unix:"+abs(*sock), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer conn.Close()
	ctx := context.Background()
	for i := 0; i < *n; i++ {
		t0 := time.Now()
		var prep, unprep fmt.Stringer
		if *api == "v1beta1" {
			c := drav1beta1.NewDRAPluginClient(conn)
			cl := []*drav1beta1.Claim{{Namespace: *ns, Name: *name, Uid: *uid}}
			var r *drav1beta1.NodePrepareResourcesResponse
			r, err = c.NodePrepareResources(ctx, &drav1beta1.NodePrepareResourcesRequest{Claims: cl})
			prep = r
			if err == nil && r.Claims[*uid].GetError() != "" {
				err = fmt.Errorf("claim error: %s", r.Claims[*uid].GetError())
			}
			if err == nil {
				t1 := time.Now()
				unprep, err = c.NodeUnprepareResources(ctx, &drav1beta1.NodeUnprepareResourcesRequest{Claims: cl})
				fmt.Printf("iter %d prepare=%v unprepare=%v\n", i, t1.Sub(t0), time.Since(t1))
			}
		} else {
			c := drav1.NewDRAPluginClient(conn)
			cl := []*drav1.Claim{{Namespace: *ns, Name: *name, Uid: *uid}}
			var r *drav1.NodePrepareResourcesResponse
			r, err = c.NodePrepareResources(ctx, &drav1.NodePrepareResourcesRequest{Claims: cl})
			prep = r
			if err == nil && r.Claims[*uid].GetError() != "" {
				err = fmt.Errorf("claim error: %s", r.Claims[*uid].GetError())
			}
			if err == nil {
				t1 := time.Now()
				unprep, err = c.NodeUnprepareResources(ctx, &drav1.NodeUnprepareResourcesRequest{Claims: cl})
				fmt.Printf("iter %d prepare=%v unprepare=%v\n", i, t1.Sub(t0), time.Since(t1))
			}
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			os.Exit(1)
		}
		if i == 0 {
			fmt.Println("prepare response:", prep)
			fmt.Println("unprepare response:", unprep)
		}
	}
}

func abs(p string) string {
	a, err := filepath.Abs(p)
	if err != nil {
		return p
	}
	return a
}
